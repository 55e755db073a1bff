"""The bench's profile summary (bench/profile.py): py-spy's raw stacks folded into where
a worker's busy time goes. Issue 14 asks for the profile behind the figures; a summary
that charged idle waiting to a library, or lost a custody function's share, would point
the next speed-up at the wrong place."""

from __future__ import annotations

from bench import profile

# py-spy names a file relative to its sys.path entry; an absolute path is read from its end
SITE = "/work/.venv/lib/python3.11/site-packages"
RAW = [
    # the process waiting for work: not busy
    "run (asyncio/runners.py:118);"
    "_run_once (asyncio/base_events.py:1898);"
    "EpollSelector.select (selectors.py:468) 50",
    # a statement's libpq call, under the receipt consumer's unit
    "cmd_run (workers/cli/processes.py:40);"
    "redo (workers/runtime/supervisor.py:99);"
    "write (workers/engine/receipts.py:210);"
    "BasePipeline._communicate_gen (psycopg/_pipeline_base.py:112) 30",
    # a receipt decoded by pydantic inside the same unit
    "cmd_run (workers/cli/processes.py:40);"
    "judge (workers/core/validation.py:77);"
    "write (workers/engine/receipts.py:201);"
    f"validate_json ({SITE}/pydantic/type_adapter.py:446) 15",
    # custody's own code at the leaf
    "cmd_run (workers/cli/processes.py:40);check (/repo/contracts/digest.py:12) 5",
    "garbage line without a count",
]


def test_idle_samples_are_apart_and_busy_ones_are_charged_to_their_leaf_library() -> None:
    p = profile.summarize("receipts-1", RAW)
    assert (p.samples, p.busy) == (100, 50)
    assert p.groups == {"psycopg": 30, "pydantic": 15, "custody": 5}
    assert p.share(p.groups["psycopg"]) == 0.6


def test_custody_functions_count_inclusively_once_per_sample_without_the_scaffolding() -> None:
    p = profile.summarize("receipts-1", RAW)
    # write appears in two stacks (45 samples), each counted once; the process's own
    # entry points (workers/cli, the supervisor), on every stack, are left out
    assert p.custody["write (engine/receipts.py)"] == 45
    assert p.custody["judge (core/validation.py)"] == 15
    assert p.custody["check (contracts/digest.py)"] == 5
    assert not any("cli/" in k or "supervisor" in k for k in p.custody)
    leaf = "BasePipeline._communicate_gen (psycopg/_pipeline_base.py)"
    assert p.leaves.most_common(1) == [(leaf, 30)]


def test_the_report_gives_each_process_its_shares_and_all_of_them_weighed_by_busy_time() -> None:
    one = profile.summarize("receipts-1", RAW)
    other = profile.summarize("committer-1", RAW[-2:])  # 5 busy samples, all custody's
    text = "\n".join(profile.markdown([one, other]))
    assert "| receipts-1 | 100 | 50 % | 10 % | 60 % | 0 % | 30 % |" in text
    assert "| committer-1 | 5 | 100 % | 100 % | 0 % |" in text
    # 55 busy samples: custody 10 of them, psycopg 30
    assert "| **all workers** | 105 | 52 % | 18 % | 55 % | 0 % | 27 % |" in text
    assert "- 90 % `write (engine/receipts.py)`" in text
