"""The metric families as data (pure: no socket): who owns each, which label values the
code records, the end-to-end histogram's range, the build info, and /readyz's answer
while draining. That a worker *process* exports exactly its own families is
tests/acceptance/test_metrics.py's."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from workers.core import names
from workers.runtime import metrics, probes

FLEET = metrics.Fleet(frozenset({"inventory", "payments"}), frozenset({"reserve"}))


def _exported(registry: CollectorRegistry) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        if family.name.endswith("_created"):  # prometheus_client's creation timestamps
            continue
        out[family.name] = [(s.name, dict(s.labels), s.value) for s in family.samples]
    return out


@pytest.mark.parametrize("worker", [*names.ENGINE_WORKERS, "participant-inventory"])
def test_a_worker_process_registers_only_the_families_its_type_owns(worker: str) -> None:
    registry = CollectorRegistry()
    metrics.register(worker, registry=registry)
    exported = set(_exported(registry))
    owned = {f.name for f in metrics.owned(names.kind_of(worker))}
    assert exported == owned
    if worker == "reconciler":
        assert "custody_successor_intents_pending" in exported
    else:  # the committer's scaler must find no one else's 0 when the reconciler is down
        assert "custody_successor_intents_pending" not in exported


def test_every_family_has_an_owner_and_every_owner_is_a_worker_type() -> None:
    names_ = [f.name for f in metrics.FAMILIES]
    assert len(names_) == len(set(names_))
    for f in metrics.FAMILIES:
        assert f.owners, f.name
        assert f.owners <= set(names.KINDS), f.name
    declared = {
        v.describe()[0].name
        for v in vars(metrics).values()
        if hasattr(v, "describe") and hasattr(v, "_labelnames")
    }
    assert declared == set(names_), "a collector outside FAMILIES would never be exported"


def test_every_label_says_which_values_the_code_records() -> None:
    for f in metrics.FAMILIES:
        for label in f.labels:
            assert label in ("worker", "owner") or label in f.values, f"{f.name}{{{label}}}"
        assert set(f.values) <= set(f.labels), f.name


def test_the_worker_label_is_the_worker_name_of_the_logs() -> None:
    by_name = {f.name: f for f in metrics.FAMILIES}
    assert by_name["custody_redeliveries"].label_values(FLEET, "worker") == frozenset(
        {"committer", "receipts", "participant-inventory", "participant-payments"}
    )
    # only engine workers hold leases
    assert by_name["custody_lease_losses"].label_values(FLEET, "worker") == frozenset(
        names.ENGINE_WORKERS
    )
    assert by_name["custody_outbox_pending_rows"].label_values(FLEET, "owner") == frozenset(
        {"engine", "inventory", "payments"}
    )
    assert names.participant_worker("inventory") == "participant-inventory"
    assert names.kind_of("participant-inventory") == names.PARTICIPANT
    with pytest.raises(ValueError, match="not a custody worker"):
        names.kind_of("inventory")


def test_label_values_come_from_the_codes_enums() -> None:
    by_name = {f.name: f for f in metrics.FAMILIES}
    statuses = by_name["custody_operations"].label_values(FLEET, "status")
    assert statuses is not None and "outcome_unknown" in statuses
    verdicts = by_name["custody_receipts"].label_values(FLEET, "verdict")
    assert verdicts is not None and {"apply", "quarantine", "no_news"} <= verdicts
    sources = by_name["custody_quarantined"].label_values(FLEET, "source")
    assert sources == frozenset(
        {"custody.requests", "custody.receipts", "participant.inventory", "participant.payments"}
    )
    assert by_name["custody_transitions"].label_values(FLEET, "kind") == frozenset(
        {"start", "successor", "deadline"}
    )
    assert by_name["custody_route_drift"].label_values(FLEET, "route") == frozenset({"reserve"})
    assert by_name["custody_outbox_publish_failures"].label_values(FLEET, "kind") is None


def test_the_end_to_end_histogram_reaches_hours() -> None:
    """An outcome_unknown operation is settled when an operator reconciles it, hours
    later: a 60 s top bucket would put all of them in +Inf."""
    buckets = list(metrics.END_TO_END._upper_bounds)
    assert buckets == sorted(buckets)
    finite = [b for b in buckets if b != float("inf")]
    assert finite[0] <= 0.01, "the happy path is milliseconds"
    assert finite[-1] >= 24 * 3600, f"top bucket {finite[-1]}s"


def test_build_info_names_the_version_the_revision_and_python() -> None:
    registry = CollectorRegistry()
    metrics.register("receipts", revision="0123456789ab", registry=registry)
    [sample] = [
        labels
        for name, labels, value in _exported(registry)["custody_build_info"]
        if labels["worker"] == "receipts" and value == 1
    ]
    assert sample == {
        "worker": "receipts",
        "version": metrics.version(),
        "revision": "0123456789ab",
        "python": platform.python_version(),
    }
    assert metrics.version() != "unknown"


def test_the_revision_of_a_git_checkout_is_read_from_its_head(tmp_path: Path) -> None:
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    assert metrics.git_head(tmp_path) is None
    (git / "packed-refs").write_text("# pack-refs\nabcdef0123456789 refs/heads/main\n")
    assert metrics.git_head(tmp_path) == "abcdef012345"
    (git / "refs" / "heads" / "main").write_text("fedcba9876543210\n")
    assert metrics.git_head(tmp_path) == "fedcba987654"
    assert metrics.git_head(tmp_path / "nowhere") is None


def test_the_publishers_dispatch_setting_is_its_own_gauge() -> None:
    registry = CollectorRegistry()
    metrics.register("publisher", dispatch_paused=True, registry=registry)
    values = {
        tuple(sorted(labels.items())): v
        for _, labels, v in _exported(registry)["custody_dispatch_paused"]
    }
    assert values[(("owner", "engine"), ("scope", "publisher"))] == 1


def test_readyz_is_503_from_the_first_moment_of_a_drain() -> None:
    health = probes.Health()
    health.checks["broker"] = lambda: True
    assert health.ready() == (True, {"broker": True})
    health.draining = True
    assert health.ready() == (False, {"broker": True})
    assert health.body() == {"ready": False, "broker": True, "draining": True}
