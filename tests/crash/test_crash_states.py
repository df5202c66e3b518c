"""Crash-state exploration: the contract holds after a power cut at any instant.

Goal: contract items 1-4 of the brief hold whatever the disk keeps of un-synced writes,
at every point of generated workloads, including during recovery itself, after a kill
followed by recovery and a power cut, and after media damage set right or set aside by
``spool check --repair``.

Method (ALICE, LevelDB's fault-injection Env): run seeded, generated workloads through a
recording file system (``spool.testing.crashsim``); for every prefix of the I/O trace build the
states the fault model (docs/fault-model.md) allows — un-synced writes lost, torn at
512-byte sectors or kept in any combination, un-synced directory operations done or not —
every combination where there are few, a seeded sample where there are many; recover each
state and check the contract against what the workload had been told
(``tests/crash/contract.py``). A sample of states is recovered under recording and the
crash states of recovery's own writes are checked as well. At a sample of prefixes the
owner is killed instead (the page cache survives), recovery runs, and power is then lost
at every point of recovery's writes and after it. Another sample gets one or two flipped
bits of durable log, which must be reported, never cut or skipped, and is then repaired,
worked on and checked again. The workloads hold attempts open across checkpoints,
acknowledge outcomes in random orders, reopen with other options, and pass operator
calls bad arguments.

The explorer proves it can see: ``test_the_explorer_catches_every_broken_spool`` runs it
against deliberately broken spools (``tests/crash/mutants.py``) and fails if any survives.

``SPOOL_CRASH_STATES`` sets how many distinct states to check (10,000 by default;
``make test-crash`` asks for 1,000,000) and ``SPOOL_CRASH_SEED`` the first workload seed.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import shutil
import tempfile
import time

import pytest

from tests.crash.explore import Explorer, ExploreReport, scratch_base
from tests.crash.mutants import FAVOURED_WORKLOADS, MUTANTS
from tests.crash.workload import MENUS, SCRIPTS, run_named

STATES = int(os.environ.get("SPOOL_CRASH_STATES", "10000"))
KILL_EVERY = 6  # kill, recover and cut the power at about one trace prefix in six
FIRST_SEED = int(os.environ.get("SPOOL_CRASH_SEED", "1"))
STEPS = 30


def explore_seeds(first: int, stride: int, target: int, **options: int) -> ExploreReport:
    """Explore workloads ``first``, ``first + stride``, ... until ``target`` new states
    (and, with the workers beside it on the other seeds, at least one workload of each
    named kind: ``stride`` workers on consecutive first seeds cover every kind once each
    has run its share of the kinds)."""
    explorer = Explorer(seed=first, **options)
    seed = first
    kinds = len(MENUS) + len(SCRIPTS)
    while True:
        r = explorer.report
        every_menu = (seed - first) // stride >= -(-kinds // stride)
        if r.states + r.recovery_states >= target and every_menu:
            return r
        base = tempfile.mkdtemp(prefix="spool-workload-", dir=scratch_base())
        try:
            recorded = run_named(base, seed, STEPS)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        explorer.explore(recorded)
        seed += stride
        _progress(first, seed, explorer.report)


def _progress(worker: int, next_seed: int, r: ExploreReport) -> None:
    """Keep each worker's running figures in ``SPOOL_REPORT_DIR`` (a long run that is cut
    short still tells how far it got)."""
    report_dir = os.environ.get("SPOOL_REPORT_DIR")
    if not report_dir:
        return
    figures = {
        "crash_states": r.states + r.recovery_states + r.kill_states,
        "after_workload_crashes": r.states,
        "after_crashes_during_recovery": r.recovery_states,
        "after_kill_recovery_power_cut": r.kill_states,
        "with_flipped_durable_bits": r.damaged_states,
        "repaired": r.repaired_states,
        "violations": len(r.violations),
        "violation_details": [str(v)[:2000] for v in r.violations[:3]],
        "next_seed": next_seed,
    }
    os.makedirs(report_dir, exist_ok=True)  # a piece's own directory, new or not
    path = os.path.join(report_dir, f"crash_states.worker{worker}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(figures, f)
    os.replace(path + ".tmp", path)


@pytest.mark.timeout(1800)  # about four minutes on two cores
def test_every_crash_state_of_generated_workloads_keeps_the_contract(
    capsys: pytest.CaptureFixture[str],
) -> None:
    workers = max(1, min(4, os.cpu_count() or 1))
    share = -(-STATES // workers)
    started = time.monotonic()
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = [
            pool.submit(
                explore_seeds,
                FIRST_SEED + w,
                workers,
                share,
                recovery_every=6,
                kill_every=KILL_EVERY,
                damage_every=5,
                repair=True,
            )
            for w in range(workers)
        ]
        reports = [f.result() for f in futures]
    states = sum(r.states for r in reports)
    during_recovery = sum(r.recovery_states for r in reports)
    after_kill = sum(r.kill_states for r in reports)
    damaged = sum(r.damaged_states for r in reports)
    repaired = sum(r.repaired_states for r in reports)
    violations = [v for r in reports for v in r.violations]
    features = set().union(*(r.features for r in reports))
    with capsys.disabled():
        print(
            f"\ncrash states checked: {states + during_recovery + after_kill} distinct "
            f"({states} after workload crashes, {during_recovery} after crashes during "
            f"recovery, {after_kill} after a kill, recovery and a power cut), and "
            f"{damaged} with flipped durable bits ({repaired} then repaired), over "
            f"{sum(r.prefixes for r in reports)} trace prefixes in "
            f"{time.monotonic() - started:.0f} s; violations: {len(violations)}; "
            f"workloads exercised: {', '.join(sorted(features))}"
        )
    report_dir = os.environ.get("SPOOL_REPORT_DIR")
    if report_dir:
        figures = {
            "crash_states": states + during_recovery + after_kill,
            "after_workload_crashes": states,
            "after_crashes_during_recovery": during_recovery,
            "after_kill_recovery_power_cut": after_kill,
            "with_flipped_durable_bits": damaged,
            "repaired": repaired,
            "violations": len(violations),
            "seconds": round(time.monotonic() - started),
        }
        with open(os.path.join(report_dir, "crash_states.json"), "w") as f:
            json.dump(figures, f, indent=1)
    assert states + during_recovery + after_kill >= STATES
    wanted = {
        "segment created",
        "restart positions replaced",
        "settings replaced",
        "segment deleted",
        "segment archived",
        "body file written",
        "body file deleted",
        "body file moved to bodies/",
        "recovery interrupted",
        "kill, recovery, power cut",
        *(f"workload {name}" for name, _menu, _outcomes in MENUS),
        *(f"workload {name}" for name, _script, _outcomes in SCRIPTS),
        *(f"step {s}" for s in ("open-attempt", "outcomes", "reopen", "bad-operator")),
    }
    assert wanted <= features, f"the workloads never exercised {sorted(wanted - features)}"
    assert not violations, "\n\n".join(str(v) for v in violations[:5])


def _seeds_favouring(workload: str | None) -> list[int]:
    """Seeds 1-40, those that pick ``workload`` (``run_named``) first."""
    kinds = [name for name, _steps, _outcomes in (*MENUS, *SCRIPTS)]
    seeds = list(range(1, 41))
    return sorted(seeds, key=lambda seed: kinds[seed % len(kinds)] != workload)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_explorer_catches_every_broken_spool(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each mutant breaks one ordering rule; exploring a few workloads must find it."""
    MUTANTS[name](monkeypatch)
    explorer = Explorer(
        seed=99, stop_at_first=True, damage_every=3, recovery_every=0, kill_every=4, repair=True
    )
    for seed in _seeds_favouring(FAVOURED_WORKLOADS.get(name)):
        base = tempfile.mkdtemp(prefix="spool-mutant-", dir=scratch_base())
        try:
            recorded = run_named(base, seed, STEPS)
        except Exception:
            return  # the mutant breaks the spool even without a crash: caught
        finally:
            shutil.rmtree(base, ignore_errors=True)
        explorer.explore(recorded)
        if explorer.report.violations:
            return
    pytest.fail(f"the explorer did not notice the broken spool {name!r} in 40 workloads")
