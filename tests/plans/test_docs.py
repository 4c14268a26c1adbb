"""wcache/plans/docs.py: docs/plans.md is what it renders now, every refusal probe is
refused with a reason, and its hand-kept evidence tables (where each CPU plan was
proven, each CUDA plan's contract) name exactly the registered plans."""

from pathlib import Path

from wcache.plans.docs import render_plans

ROOT = Path(__file__).resolve().parents[2]


def test_plans_md_is_current():
    """docs/plans.md equals `wcache plans --markdown` (run `make docs` after changing a plan)."""
    assert (ROOT / "docs" / "plans.md").read_text() == render_plans(markdown=True)


def test_every_refusal_probe_is_refused():
    """Each case the issues say must be refused raises NoPlan with a reason (none resolves)."""
    from wcache.plans.docs import REFUSAL_PROBES, refusals

    rows = refusals()
    assert len(rows) == len(REFUSAL_PROBES)
    assert [case for case, reason in rows if reason.startswith("NOT REFUSED")] == []
    assert all(len(reason) > 40 for _, reason in rows)


def test_every_cpu_plan_states_where_it_was_proven():
    """docs/plans.md's proven-on table covers every CPU plan (and names no unknown plan)."""
    from wcache.plans import all_plans
    from wcache.plans.docs import PROVEN_ON

    assert set(PROVEN_ON) == {p.id for p in all_plans() if "cpu" in p.devices}


def test_every_cuda_plan_states_its_contract():
    """docs/plans.md's CUDA table covers every CUDA plan (and names no unknown plan)."""
    from wcache.plans import all_plans
    from wcache.plans.docs import CUDA_CONTRACTS

    assert set(CUDA_CONTRACTS) == {p.id for p in all_plans() if "cuda" in p.devices}
