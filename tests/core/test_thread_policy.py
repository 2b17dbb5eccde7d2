"""The command line's thread policy (headspace.core.threads): a pure function of cores, load and
environment, applied by ``headspace``'s entry point before torch is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from headspace.core.errors import UsageError
from headspace.core.threads import ThreadPlan, configure, others_running, plan_threads


def test_a_quiet_machine_keeps_torch_s_threads_and_the_runtime_s_wait_policy() -> None:
    plan = plan_threads(2, 0, {})
    assert plan == ThreadPlan(2, {}, plan.reason)  # torch's own default: one thread per physical core
    assert plan_threads(16, 0.4, {}).threads == 16  # a stray task now and then is not a competitor


def test_one_competing_process_leaves_its_core_to_it() -> None:
    assert plan_threads(2, 1, {}).threads == 1  # the 2-core case of issue 41: 158 s -> 49.7 s
    assert plan_threads(2, 5, {}).threads == 1  # never fewer than one
    many = plan_threads(16, 1, {})
    assert many.threads == 15
    # others share the machine and threads wait for each other: they sleep instead of spinning
    assert many.env == {"OMP_NUM_THREADS": "15", "OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


def test_the_user_s_settings_win() -> None:
    assert plan_threads(2, 1, {"HEADSPACE_THREADS": "2"}).threads == 2
    assert plan_threads(2, 1, {"HEADSPACE_THREADS": "2"}).env["OMP_NUM_THREADS"] == "2"
    assert plan_threads(8, 0, {"HEADSPACE_THREADS": "auto"}).threads == 8
    user = plan_threads(8, 3, {"OMP_NUM_THREADS": "4", "OMP_WAIT_POLICY": "ACTIVE"})
    assert user.threads == 4
    assert user.env == {"KMP_BLOCKTIME": "0"}  # the user's OMP_* stay as they are
    assert plan_threads(8, 3, {"HEADSPACE_THREADS": "3", "OMP_NUM_THREADS": "6"}).threads == 3
    assert plan_threads(8, 0, {"OMP_NUM_THREADS": "4,2"}).threads == 4  # OpenMP's nested form


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_setting_is_one_line(value: str) -> None:
    with pytest.raises(UsageError, match=r"HEADSPACE_THREADS must be a positive integer or 'auto'; got"):
        plan_threads(2, 0, {"HEADSPACE_THREADS": value})


def test_others_running_is_the_median_runnable_count_less_this_process() -> None:
    reads = iter([3, 1, 2, 9, 2])
    assert others_running(samples=5, gap=0, read=lambda: next(reads)) == 1.0
    assert others_running(samples=3, gap=0, read=lambda: 1) == 0.0


def test_configure_sets_only_what_the_user_has_not(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    before = torch.get_num_threads()
    env = {"HEADSPACE_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"}
    try:
        plan = configure(env)
        assert plan.threads == 1 and torch.get_num_threads() == 1
        assert env["OMP_NUM_THREADS"] == "1" and env["OMP_WAIT_POLICY"] == "ACTIVE"
    finally:
        torch.set_num_threads(before)


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "HEADSPACE_THREADS")}
    return subprocess.run(
        [sys.executable, "-c", code], env={**full, **env}, capture_output=True, text=True, timeout=120
    )


def test_the_entry_point_chooses_threads_before_torch_starts() -> None:
    code = (
        "import sys\nfrom headspace.cli import main\n"
        "assert 'torch' not in sys.modules\n"
        "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "import os, torch\nprint(os.environ['OMP_NUM_THREADS'], torch.get_num_threads())\n"
    )
    done = _run(code, HEADSPACE_THREADS="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["1", "1"]  # after --version's line


def test_the_entry_point_refuses_a_bad_setting_in_one_line() -> None:
    done = _run("from headspace.cli import main\nmain(['--version'])", HEADSPACE_THREADS="zero")
    assert done.returncode == 2
    assert done.stderr == "error: HEADSPACE_THREADS must be a positive integer or 'auto'; got 'zero'\n"


@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="the runnable count is Linux's /proc/loadavg")
def test_a_spinning_competitor_is_counted_and_leaves_a_2_core_machine_one_thread() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # running
        others = others_running()
        assert others >= 1
        assert plan_threads(2, others, {}).threads == 1
    finally:
        spinner.kill()
        spinner.wait()
