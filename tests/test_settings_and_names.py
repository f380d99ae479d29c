"""Settings and names: every invalid value gets a clear error naming what to fix."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mqorder import orderly_listener
from mqorder.client.dedup import DedupDerive
from mqorder.errors import ConfigError, InvalidNameError, ListenerError
from mqorder.keys import BROKER_RE, NAME_RE
from mqorder.names import check_broker, check_client_id, check_group, check_name, check_topic
from mqorder.rebalance.allocate import AllocateStrategy
from mqorder.retention.policy import RetentionPolicy
from mqorder.settings import load_settings
from mqorder.store.brokers import redact_url
from tests.support import ROOT


def test_defaults_are_rocketmqs() -> None:
    s = load_settings(redis_url="redis://127.0.0.1:1/0")
    assert (s.lock_max_live_time_ms, s.lock_interval_ms, s.client_lock_expire_ms) == (60_000, 20_000, 30_000)
    assert (s.suspend_current_queue_time_ms, s.max_time_consume_continuously_ms) == (1000, 60_000)
    assert (s.consume_message_batch_max_size, s.pull_batch_size, s.max_reconsume_times) == (1, 32, 16)
    assert (s.pull_threshold_for_queue, s.max_message_size) == (1000, 4 * 1024 * 1024)
    assert (s.send_msg_timeout_ms, s.retry_times_when_send_failed) == (3000, 2)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("pull_batch_size", 0, "MQORDER_PULL_BATCH_SIZE"),
        ("max_reconsume_times", -2, "MQORDER_MAX_RECONSUME_TIMES"),
        ("lock_max_live_time_ms", 0, "MQORDER_LOCK_MAX_LIVE_TIME_MS"),
        ("redis_url", "http://x", "redis://"),
        ("redis_url", "", "MQORDER_REDIS_URL"),
        ("allocate_strategy", "random", "choose one of"),
        ("suspend_current_queue_time_ms", 5, "MQORDER_SUSPEND_CURRENT_QUEUE_TIME_MS"),
        ("heartbeat_timeout_ms", 500, "longer than heartbeat_interval_ms"),
        ("lock_interval_ms", 90_000, "shorter than lock_max_live_time_ms"),
        ("run_lease_ms", 1500, "consume_linger_ms .* at most half of run_lease_ms"),
        ("heartbeat_interval_ms", 0.5, "MQORDER_HEARTBEAT_INTERVAL_MS"),
        ("dedup_derive", "sha1", "choose one of none, msg_id, content"),
        ("retention_policy", "forever", "choose one of time, consumed"),
        ("brokers", {"b": "ftp://x"}, "MQORDER_BROKERS"),
        # A bool is not a number (it was read as 1 or 0).
        ("retry_times_when_send_failed", True, r"MQORDER_RETRY_TIMES_WHEN_SEND_FAILED\) must be a number, got True"),
        ("pull_batch_size", False, r"MQORDER_PULL_BATCH_SIZE\) must be a number, got False"),
        ("metrics_port", True, "MQORDER_METRICS_PORT"),  # its own validator's words
    ],
)
def test_bad_settings_name_the_variable_and_the_rule(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(**{field: value})


@pytest.mark.parametrize(
    ("old", "value", "new"),
    [
        ("MQORDER_HEARTBEAT_INTERVAL", "0.5", "MQORDER_HEARTBEAT_INTERVAL_MS=500"),
        ("MQORDER_LOCK_MAX_LIVE_TIME", "60", "MQORDER_LOCK_MAX_LIVE_TIME_MS=60000"),
        ("MQORDER_SUSPEND_CURRENT_QUEUE_TIME_MILLIS", "300", "MQORDER_SUSPEND_CURRENT_QUEUE_TIME_MS=300"),
        ("mqorder_run_lease", "soon", "MQORDER_RUN_LEASE_MS=<milliseconds>"),
    ],
)
def test_a_renamed_variable_still_set_is_refused_naming_its_replacement(
    monkeypatch: pytest.MonkeyPatch, old: str, value: str, new: str,
) -> None:
    """Durations became ``*_ms`` integers: an old variable left in the environment (or a .env file)
    would otherwise be ignored, and the worker would run on the defaults without a word."""
    monkeypatch.setenv(old, value)
    with pytest.raises(ConfigError) as exc:
        load_settings()
    assert f"{old.upper()} was renamed {new.split('=')[0]} (milliseconds): set {new}" in str(exc.value)


def test_a_renamed_keyword_is_refused_naming_its_replacement() -> None:
    with pytest.raises(ConfigError, match=r"'send_msg_timeout' was renamed 'send_msg_timeout_ms' .*"
                                          r"send_msg_timeout_ms=1500"):
        load_settings(send_msg_timeout=1.5)


def test_string_choices_are_enums_and_accept_case_and_dashes() -> None:
    s = load_settings(redis_url="redis://127.0.0.1:1/0", allocate_strategy="Averagely-By-Circle",
                      dedup_derive="MSG-ID", retention_policy=" Consumed ")
    assert s.allocate_strategy is AllocateStrategy.AVERAGELY_BY_CIRCLE
    assert s.dedup_derive is DedupDerive.MSG_ID
    assert s.retention_policy is RetentionPolicy.CONSUMED
    assert s.describe()["allocate_strategy"] == "averagely_by_circle"  # plain JSON for `mqorder config`


def test_bad_environment_variable_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MQORDER_PULL_BATCH_SIZE", "lots")
    with pytest.raises(ConfigError, match="MQORDER_PULL_BATCH_SIZE"):
        load_settings()


@pytest.mark.parametrize(("var", "value", "form"), [
    ("MQORDER_BROKERS", "broker-b=redis://127.0.0.1:6380/0", '{"broker-b": "redis://host-b:6379/0"}'),
    ("MQORDER_ALLOCATE_CONFIG", "foo", '{"w1@host": ["orders:broker-a:0"'),
    ("MQORDER_ALLOCATE_MACHINE_ROOMS", "a,b", '["room-a", "room-b"]'),
])
def test_a_json_setting_that_is_not_json_names_its_variable_and_the_form(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, form: str
) -> None:
    """pydantic-settings said only 'error parsing value for field "brokers" from source
    "EnvSettingsSource"': neither the variable nor that it wants JSON."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as exc:
        load_settings()
    msg = str(exc.value)
    assert f"{var}: not valid JSON" in msg and form in msg and "EnvSettingsSource" not in msg


def test_bad_url_errors_never_echo_the_password() -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(redis_url="http://user:hunter2@host:1/0")
    assert "hunter2" not in str(exc.value)


@given(st.integers(min_value=-10**6, max_value=10**6))
def test_any_integer_pull_batch_size_is_accepted_or_clearly_refused(n: int) -> None:
    try:
        s = load_settings(redis_url="redis://h:1/0", pull_batch_size=n)
    except ConfigError as exc:
        assert "MQORDER_PULL_BATCH_SIZE" in str(exc)
        assert not 1 <= n <= 1024
    else:
        assert s.pull_batch_size == n and 1 <= n <= 1024


#: Names drawn from the charset's odd corners as well as from everything.
ANY_NAME = st.one_of(st.text(max_size=200), st.text(alphabet="%|_.-@:#{}BCDLQa0 \n", max_size=140))


@given(ANY_NAME)
def test_names_are_accepted_iff_they_match_the_documented_charset(name: str) -> None:
    ok = bool(NAME_RE.fullmatch(name)) and "%BC%" not in name and not name.endswith("%BC")
    try:
        check_name("group", name)
    except InvalidNameError as exc:
        assert not ok
        assert "group" in str(exc)
    else:
        assert ok


@given(ANY_NAME)
def test_broker_names_also_allow_the_machine_room_at_sign(name: str) -> None:
    ok = bool(BROKER_RE.fullmatch(name))
    assert ok == (bool(NAME_RE.fullmatch(name.replace("@", "a"))))
    try:
        check_broker(name)
    except InvalidNameError as exc:
        assert not ok
        assert "broker" in str(exc)
    else:
        assert ok


@given(ANY_NAME)
def test_topic_names_are_the_charset_minus_the_dead_letter_prefix(name: str) -> None:
    ok = bool(NAME_RE.fullmatch(name)) and not name.startswith("%DLQ%")
    try:
        check_topic(name)
    except InvalidNameError:
        assert not ok
    else:
        assert ok


@pytest.mark.parametrize("group", ["g%BC", "%BC", "a%BC%b", "%BC%"])
def test_a_group_may_not_hold_or_end_with_the_broadcast_separator(group: str) -> None:
    """``g%BC`` + ``%BC%`` + ``x`` would read back as group ``g``."""
    with pytest.raises(InvalidNameError, match="reserved"):
        check_group(group)


def test_the_dead_letter_topic_of_any_valid_group_is_a_valid_topic() -> None:
    longest = "g" * 127
    assert check_topic(f"%DLQ%{longest}", allow_dlq=True) == f"%DLQ%{longest}"
    for not_a_group in ("", "a b", "g%BC", "x" * 128):
        with pytest.raises(InvalidNameError, match="dead-letter"):
            check_topic(f"%DLQ%{not_a_group}", allow_dlq=True)


@given(st.one_of(st.integers(), st.none(), st.binary(), st.lists(st.text())))
def test_non_string_names_are_refused(value: object) -> None:
    with pytest.raises(InvalidNameError, match="must be a str"):
        check_name("topic", value)


def test_dlq_prefix_is_reserved_for_dead_letter_topics() -> None:
    with pytest.raises(InvalidNameError, match="reserved"):
        check_topic("%DLQ%billing")
    assert check_topic("%DLQ%billing", allow_dlq=True) == "%DLQ%billing"


@given(st.text(max_size=300))
def test_client_ids_refuse_whitespace_control_characters_and_braces(cid: str) -> None:
    bad = not cid or len(cid) > 255 or any(c.isspace() or c in "{}\x7f" or ord(c) < 0x20 for c in cid)
    bad = bad or cid == "~"  # keys.NOBODY
    if bad:
        with pytest.raises(InvalidNameError):
            check_client_id(cid)
    else:
        try:
            assert check_client_id(cid) == cid
        except InvalidNameError:
            # The regex's \s is narrower than str.isspace for a few code points; refusal is safe.
            assert any(not c.isprintable() for c in cid)


@given(st.text(alphabet=st.characters(blacklist_characters="@/:", blacklist_categories=("Cs",)), min_size=1, max_size=30))
def test_redact_url_hides_any_password(pw: str) -> None:
    from urllib.parse import quote

    url = f"redis://user:{quote(pw, safe='')}@host:6379/0"
    out = redact_url(url)
    assert out == "redis://user:***@host:6379/0"


def test_listener_registration_refuses_bad_arguments() -> None:
    with pytest.raises(ListenerError, match="two arguments"):
        orderly_listener(topic="t", group="g-bad-sig")(lambda msgs: None)
    with pytest.raises(ListenerError, match="consume_message_batch_max_size"):
        orderly_listener(topic="t", group="g", consume_message_batch_max_size=0)
    with pytest.raises(ListenerError, match="BROADCASTING"):
        orderly_listener(topic="t", group="g", message_model="fanout")
    with pytest.raises(InvalidNameError):
        orderly_listener(topic="bad topic", group="g")


def test_cli_config_reports_bad_settings_and_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mqorder.cli", "config"], cwd=ROOT, capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", "MQORDER_PULL_BATCH_SIZE": "0", "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2
    assert "MQORDER_PULL_BATCH_SIZE" in proc.stdout + proc.stderr


@pytest.mark.parametrize("value", ["orders\n", "w1@host\n"])
def test_a_trailing_newline_is_not_part_of_a_valid_name(value: str) -> None:
    """Found by hypothesis: a regex ending in ``$`` also matches before a final newline."""
    with pytest.raises(InvalidNameError):
        check_client_id(value) if "@" in value else check_topic(value)


def test_the_nobody_assignee_is_not_a_client_id() -> None:
    """A worker named ``~`` would be mistaken for "no client" and never get a queue."""
    from mqorder import keys

    with pytest.raises(InvalidNameError, match="reserved"):
        check_client_id(keys.NOBODY)
    assert check_client_id("~w@host") == "~w@host"


def test_a_misspelt_keyword_is_refused_naming_the_closest_settings() -> None:
    """``extra="ignore"`` dropped it without a word: ``transaction_check_max`` stayed 15."""
    with pytest.raises(ConfigError, match=r"unknown setting 'transaction_chek_max'; did you mean "
                                          r"'transaction_check_max'") as exc:
        load_settings(redis_url="redis://127.0.0.1:1/0", transaction_chek_max=3)
    assert str(exc.value).count("invalid mqorder settings") == 1
    with pytest.raises(ConfigError, match=r"unknown setting 'zzz'; the settings are listed in docs/SETTINGS.md"):
        load_settings(zzz=1)


def test_a_delay_level_past_a_year_is_refused() -> None:
    """``999999999999d`` held every message of that level for ever, without a word."""
    assert load_settings(redis_url="redis://127.0.0.1:1/0", message_delay_level="1s 366d").delay_levels_ms[-1] == \
        366 * 86_400_000
    with pytest.raises(ConfigError, match=r"delay level '999999999999d' is longer than 366 days"):
        load_settings(redis_url="redis://127.0.0.1:1/0", message_delay_level="1s 999999999999d")
