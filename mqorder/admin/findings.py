"""What ``mqorder doctor`` reports: a ``Finding`` per check, with its ``Verdict``, in a ``DoctorReport``.

Its own module so that every family of checks (``doctor``: Redis and Celery; ``doctor_ha``:
replication and Sentinel) builds findings without importing another family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Verdict(StrEnum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Finding:
    check: str
    verdict: Verdict
    detail: str
    #: What to do about it (empty when OK).
    fix: str = ""
    #: The broker it is about ('' for Celery and cluster-wide checks).
    broker: str = ""
    #: The figures behind ``detail``, for ``--json`` readers (replicas and their lag, a Sentinel's
    #: view...): a script should not have to parse the sentence.
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "broker": self.broker, "verdict": self.verdict.value, "detail": self.detail,
                "fix": self.fix, "data": self.data}


@dataclass
class DoctorReport:
    findings: list[Finding] = field(default_factory=list)

    def failed(self, strict: bool = False) -> bool:
        bad = {Verdict.FAIL, Verdict.WARN} if strict else {Verdict.FAIL}
        return any(f.verdict in bad for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {"ok": not self.failed(), "findings": [f.to_json() for f in self.findings]}
