"""``new_token``: dispatch tokens, run ids and mutex values only have to be unique, in this
process, across threads and in forked children (prefork pool children fork from one parent)."""

from __future__ import annotations

import os
import re
import threading

from mqorder.tokens import new_token


def test_tokens_are_32_hex_digits_and_never_repeat_across_threads_and_a_fork() -> None:
    mine = [new_token() for _ in range(20_000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in mine)
    others: list[str] = []
    threads = [threading.Thread(target=lambda: others.extend(new_token() for _ in range(5_000))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child of this process: its tokens are its own
        os.write(w, "".join(new_token() for _ in range(1_000)).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child = re.findall(r"[0-9a-f]{32}", f.read())
    os.waitpid(pid, 0)
    assert len(child) == 1_000
    everything = mine + others + child
    assert len(set(everything)) == len(everything)
