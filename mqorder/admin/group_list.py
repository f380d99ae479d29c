"""``mqorder group list [--check]``: every consumer group on one screen.

``mqorder status`` answers for one group; an operator of many groups (60 in a walk-through) ran it
60 times, a CLI start and a few round trips each, two minutes to learn whether anything was stuck,
and had no command that listed the groups at all. This reads every group's status in one process
(``group_status`` per group) and the live clients once: per group its topics, live consumers,
queue lanes, lag and stuck lanes. ``--check`` exits 1 when any group has a stuck queue, as
``status --check`` does for one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mqorder.admin.common import Admin
from mqorder.admin.status import group_status


@dataclass(frozen=True)
class GroupSummary:
    group: str
    topics: list[str]
    models: list[str]  # CLUSTERING / BROADCASTING, once each
    live_consumers: int
    lanes: int  # queue lanes (a broadcasting group: one per client and queue)
    lag: int
    stuck: int
    missing_topics: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GroupList:
    stuck_after_ms: int
    groups: list[GroupSummary] = field(default_factory=list)

    @property
    def stuck(self) -> list[GroupSummary]:
        return [g for g in self.groups if g.stuck]

    def to_json(self) -> dict[str, Any]:
        return {"stuck_after_ms": self.stuck_after_ms, "stuck_groups": len(self.stuck),
                "groups": [g.to_json() for g in self.groups]}


def group_list(admin: Admin, stuck_after_s: float) -> GroupList:
    out = GroupList(int(stuck_after_s * 1000))
    live, _, _ = admin.registry.clients()
    for group, topics in sorted(admin.topics.groups().items()):
        st = group_status(admin, group, stuck_after_s=stuck_after_s)
        out.groups.append(GroupSummary(
            group=group, topics=sorted(topics), models=sorted({m.value for m in topics.values()}),
            live_consumers=sum(1 for c in live if any(s.group == group for s in c.subscriptions)),
            lanes=len(st.queues), lag=st.lag, stuck=len(st.stuck), missing_topics=st.missing_topics,
        ))
    return out
