"""Read a run directory (what ``privtune train`` / ``privtune tune`` wrote) for the report.

Every file is optional except that at least one of ``certificate.json``, ``metrics.json``
and ``history.json`` must exist.  Parts that are missing or unreadable are recorded in
:attr:`RunData.problems` and shown in the report, never silently dropped.

By default only what the run releases is read: anything computed from private data without
noise (the batch loss of DP-SGD, clipping diagnostics, a non-private reference) is left out, also
when an older run directory still holds it in ``history.json`` / ``metrics.json``.  With
``include_non_private=True`` the NOT PRIVATE part (``RUN_DIR/not_private/``) is read as well.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from privtune.accounting.certificate import union_bound_epsilon
from privtune.accounting.events import event_from_dict
from privtune.errors import InvalidParameterError
from privtune.report.release import SEEDED_LABEL, PublicPaths, load_not_private, split_release

RUN_FILES = ("certificate.json", "metrics.json", "history.json", "config.yaml")


@dataclass
class RunData:
    """The parsed contents of a run directory (empty dicts for missing files)."""

    run_dir: Path
    certificate: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    history: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    #: True when the NOT PRIVATE part was loaded (the report then goes to RUN_DIR/not_private/)
    include_non_private: bool = False

    # ----------------------------------------------------------------- convenience
    @property
    def delta(self) -> float | None:
        d = self.certificate.get("delta", self.metrics.get("delta"))
        return float(d) if isinstance(d, (int, float)) else None

    @property
    def epsilon(self) -> float | None:
        e = self.certificate.get("epsilon", self.metrics.get("epsilon"))
        return float(e) if isinstance(e, (int, float)) else None

    @property
    def guarantee_epsilon(self) -> float | None:
        """The ε of the run's (ε, δ) guarantee: the certificate's, or, where ``--mode auto``'s pilots chose one of
        k > 1 plans each made at δ/k (``mode_plans`` in the certificate's metadata), the requested total: by a
        union bound over the plans the run is (total ε, δ)-DP whichever was chosen, while the events that ran
        compose to the certificate's ε at δ (docs/accounting.md)."""
        eps = self.epsilon
        return None if eps is None else union_bound_epsilon(eps, self.metadata.get("mode_plans"),
                                                            self.metadata.get("total_epsilon_requested"))

    def union_bound_words(self) -> str:
        """A sentence on the union bound behind :attr:`guarantee_epsilon`, or "" where it is the certificate's ε."""
        eps, guarantee = self.epsilon, self.guarantee_epsilon
        if eps is None or guarantee is None or guarantee == eps or self.delta is None:
            return ""
        k = self.metadata.get("mode_plans")
        return (f"The mode pilots chose one of {k} plans, each made so that the pilots and its run compose to "
                f"ε = {guarantee:.4g} at δ/{k}; by a union bound over the plans the run is (ε = {guarantee:.4g}, "
                f"δ = {self.delta:.1e})-DP whichever was chosen. The events that ran compose to ε = {eps:.4g} at "
                f"δ = {self.delta:.1e} (the certificate's ε).")

    @property
    def accountant(self) -> str:
        return str(self.certificate.get("accountant") or self.config.get("accountant") or "pld")

    @property
    def metadata(self) -> dict:
        md = self.certificate.get("metadata")
        return md if isinstance(md, dict) else {}

    @property
    def strategy(self) -> dict:
        s = self.history.get("strategy")
        return s if isinstance(s, dict) else {}

    @property
    def strategy_name(self) -> str | None:
        name = self.strategy.get("name") or self.metrics.get("strategy") or self.metadata.get("strategy")
        return str(name) if name else None

    @property
    def trials(self) -> list[dict]:
        t = self.history.get("trials")
        return [x for x in t if isinstance(x, dict)] if isinstance(t, list) else []

    @property
    def final_run(self) -> dict:
        f = self.history.get("final_run")
        return f if isinstance(f, dict) else {}

    @property
    def seeded(self) -> bool:
        """True for a run with an explicit seed (its noise is reproducible: NOT PRIVATE)."""
        return (self.metadata.get("label") == SEEDED_LABEL or bool(self.metadata.get("seeded"))
                or self.metrics.get("label") == SEEDED_LABEL or bool(self.metrics.get("seeded")))

    @property
    def not_private(self) -> bool:
        """True for runs whose tuning was not charged (grid oracle)."""
        name = (self.strategy_name or "").lower()
        return name in ("grid-oracle", "grid_oracle") or bool(self.metrics.get("not_private"))

    def public(self) -> RunData:
        """A copy in which every path of this machine is written by its name (:class:`PublicPaths`): what
        the report and the model card show, also for a run directory written before its files were."""
        pub = PublicPaths(self.run_dir, [v for v in self.config.values() if isinstance(v, str)])
        return dataclasses.replace(self, certificate=pub.value(self.certificate), metrics=pub.value(self.metrics),
                                   history=pub.value(self.history), config=pub.value(self.config),
                                   problems=pub.value(self.problems))


def _read_json(path: Path, problems: list[str]) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problems.append(f"{path.name} could not be read ({exc}); the parts that depend on it are missing.")
        return {}
    if not isinstance(data, dict):
        problems.append(f"{path.name} does not hold a JSON object; ignored.")
        return {}
    return data


def load_run(run_dir: str | os.PathLike, *, include_non_private: bool = False) -> RunData:
    """Read ``certificate.json``, ``metrics.json``, ``history.json`` and ``config.yaml``.

    ``include_non_private`` also reads ``RUN_DIR/not_private/`` (NOT PRIVATE figures); without it
    they are dropped, wherever they are found.

    Raises InvalidParameterError when ``run_dir`` is not a directory or holds none of the
    JSON files.
    """
    p = Path(run_dir)
    if not p.is_dir():
        raise InvalidParameterError(
            f"`run_dir` must be an existing run directory. Got {str(run_dir)!r}, which "
            f"{'is a file' if p.exists() else 'does not exist'}. "
            "Pass the --output directory of `privtune train` or `privtune tune`."
        )
    if not any((p / f).is_file() for f in RUN_FILES[:3]):
        raise InvalidParameterError(
            f"`run_dir` {str(run_dir)!r} holds none of certificate.json, metrics.json, history.json: "
            "it is not a privtune run directory. Pass the --output directory of `privtune train` or `privtune tune`."
        )
    run = RunData(run_dir=p)
    for name, attr in (("certificate.json", "certificate"), ("metrics.json", "metrics"), ("history.json", "history")):
        f = p / name
        if f.is_file():
            setattr(run, attr, _read_json(f, run.problems))
        elif name == "certificate.json":
            run.problems.append(
                "certificate.json is missing: this run has no privacy certificate (it may have been interrupted; "
                "rerun it with --resume)."
            )

    run.metrics, run.history, legacy = split_release(run.metrics, run.history)
    if include_non_private:
        run.include_non_private = True
        extra = load_not_private(p)
        for part in ("metrics", "history"):
            merged = dict(legacy.get(part, {}))
            merged.update({k: v for k, v in extra.get(part, {}).items() if k != "label"})
            if part == "metrics":
                run.metrics.update(merged)
                continue
            fr = merged.pop("final_run", None)
            run.history.update(merged)
            if isinstance(fr, dict):
                run.history["final_run"] = {**run.final_run, **{k: v for k, v in fr.items() if v is not None}}
    cfg = p / "config.yaml"
    if cfg.is_file():
        try:
            data = yaml.safe_load(cfg.read_text(encoding="utf-8"))
            run.config = data if isinstance(data, dict) else {}
        except yaml.YAMLError as exc:
            run.problems.append(f"config.yaml could not be read ({str(exc).splitlines()[0]}).")
    return run


def load_events(dicts: Any) -> list:
    """Event dicts -> privtune events (raises CertificateError on malformed ones)."""
    if not isinstance(dicts, list):
        return []
    return [event_from_dict(d) for d in dicts]
