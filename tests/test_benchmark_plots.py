"""The implementation study's plots: one line per backend, log scales, files written whole."""

import pytest
from tool_runner import load_tool


def test_plot_study_draws_time_and_memory(tmp_path, monkeypatch):
    tool = load_tool("benchmark_attention")
    study = {
        28: {"sdpa (full attention)": (0.03, 50.0, 5.0), "sliding_chunk": (0.05, 90.0, 9.0)},
        56: {"sdpa (full attention)": (0.4, 70.0, 2.0), "sliding_chunk": (0.15, 190.0, 5.0), "reference": "skipped"},
    }
    drawn = []
    import matplotlib.axes

    real_plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes, "plot", lambda self, *a, **k: drawn.append((a, k)) or real_plot(self, *a, **k)
    )
    tool.plot_study(study, str(tmp_path / "study"), "title")
    for what in ("time", "memory"):
        data = (tmp_path / f"study_{what}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # Two figures, two lines each (the skipped reference has no point); time in ms, memory in MiB.
    assert [k["label"] for _, k in drawn] == ["sdpa (full attention)", "sliding_chunk"] * 2
    assert drawn[0][0] == ((28, 56), (30.0, 400.0))
    assert drawn[3][0] == ((28, 56), (90.0, 190.0))
    assert not list(tmp_path.glob(".tmp-*"))


def test_study_1d_table_and_plots(tmp_path, monkeypatch, capsys):
    """A tiny ``--dim 1`` run end to end. The workers (one per size) run in this process (a fresh one costs seconds
    of imports), but for one, which checks that the options travel to a real worker; the default backend is not
    built here."""
    import contextlib
    import io
    import subprocess

    tool = load_tool("benchmark_attention")
    real_popen = subprocess.Popen
    workers = []

    class InProcess:
        """A worker run here: its stdout into the file the study gives it, its stderr kept for the study to read."""

        def __init__(self, argv, stdout, stderr, **kwargs):
            workers.append(argv)
            errors = io.StringIO()
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(errors):
                tool.main(argv[2:])
            self.stderr = io.StringIO(errors.getvalue())

        def wait(self):
            return 0

    monkeypatch.setattr(tool.subprocess, "Popen", InProcess)
    monkeypatch.setattr(tool, "default_backend", lambda device, dtype, dims: f"picked for {dims}D")
    argv = [
        "--dim",
        "1",
        "--sizes",
        "64",
        "128",
        "--heads",
        "2",
        "--head-dim",
        "8",
        "--window",
        "8",
        "--repeats",
        "1",
        "--causal",
        "--backends",
        "sliding_chunk",
        "loop",
        "chunks",
    ]
    tool.main(argv + ["--markdown", str(tmp_path / "study.md"), "--plot", str(tmp_path / "study")])
    table = (tmp_path / "study.md").read_text().splitlines()
    assert "2 heads x 8, sequences, w=8 on each side, dilation 1, causal, 0 global" in table[1]
    assert table[1].endswith("backend=None picks 'picked for 1D'") and table[3].startswith(
        "| length | backend | time (ms) |"
    )
    rows = [line.split(" | ") for line in table if line.startswith("| 64 ") or line.startswith("| 128 ")]
    assert [(r[0], r[1]) for r in rows] == [
        (f"| {n}", b) for n in (64, 128) for b in (tool.SDPA, "sliding_chunk", "loop", "chunks")
    ]
    assert all(
        float(r[2]) > 0 and float(r[3]) >= 0 and r[5].endswith("x") and float(r[7].rstrip(" |")) >= 0 for r in rows
    ), rows
    for size in (64, 128):  # "vs SDPA": SDPA's time over the row's, within the printed times' rounding (0.05 ms)
        times = {r[1]: float(r[2]) for r in rows if r[0] == f"| {size}"}
        for name, took in times.items():
            speedup = float(next(r[5] for r in rows if r[:2] == [f"| {size}", name]).rstrip("x"))
            assert (times[tool.SDPA] - 0.05) / (took + 0.05) - 0.005 <= speedup, (size, name, times, speedup)
            assert took <= 0.05 or speedup <= (times[tool.SDPA] + 0.05) / (took - 0.05) + 0.005, (size, name, times)
    assert len(workers) == 2 and all(
        "--causal" in w and w[w.index("--dilation") + 1] == "1" and "--exact" not in w for w in workers
    )
    for what in ("time", "memory"):
        assert (tmp_path / f"study_{what}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr()
    assert "64: fastest local backend" in printed.out
    # Each backend's first call is reported as it ends, passed on from the worker's stderr.
    assert "progress: sliding_chunk at 64: first call" in printed.err and "progress: loop at 128" in printed.err

    # A run stopped before its last size (a time limit) leaves the rows it measured, not the earlier run's table.
    measured = tool.run_size

    def stopped_at_128(args, backends, size, report):
        if size == 128:
            raise KeyboardInterrupt
        return measured(args, backends, size, report)

    monkeypatch.setattr(tool, "run_size", stopped_at_128)
    with pytest.raises(KeyboardInterrupt):
        tool.main(argv[:-4] + ["--backends", "loop", "--markdown", str(tmp_path / "study.md")])
    monkeypatch.setattr(tool, "run_size", measured)
    rows = [line.split(" | ")[:2] for line in (tmp_path / "study.md").read_text().splitlines() if line[:3] == "| 6"]
    assert rows == [["| 64", tool.SDPA], ["| 64", "loop"]]
    assert "| 128 " not in (tmp_path / "study.md").read_text()
    capsys.readouterr()

    # --profile: the worker's profiler tables reach the output, after the size's rows.
    tool.main(argv[:-4] + ["--backends", "sliding_chunk", "--sizes", "64", "--profile"])
    out = capsys.readouterr().out
    assert "--profile" in workers[-1]
    assert out.index("| 64 | sliding_chunk |") < out.index("sliding_chunk at 64, one forward+backward:")
    assert "Self CPU" in out

    # A worker stopped in its profiles (a time limit) has given its rows already: they are in the table.
    class StoppedInItsProfiles(InProcess):
        def wait(self):
            return -9

    monkeypatch.setattr(tool.subprocess, "Popen", StoppedInItsProfiles)
    tool.main(argv[:-4] + ["--backends", "loop", "--sizes", "64", "--profile", "--markdown", str(tmp_path / "cut.md")])
    rows = [line.split(" | ")[:3] for line in (tmp_path / "cut.md").read_text().splitlines() if line[:4] == "| 64"]
    assert [row[:2] for row in rows] == [["| 64", tool.SDPA], ["| 64", "loop"]] and float(rows[1][2]) > 0
    assert "The profiles at 64 stopped: killed by signal 9" in capsys.readouterr().out
    monkeypatch.setattr(tool.subprocess, "Popen", InProcess)

    # The skipping rules answer without a worker; one size in a real fresh process, where a backend's failure is
    # its own row.
    args = tool.parse_args(argv[:-4] + ["--dilation", "2"])
    assert tool.skip_reason(args, "chunks", 64) is None  # chunks takes dilated bands (split by residue class)
    reported = []
    assert tool.run_size(args, [tool.SDPA], 32768, reported.append)[tool.SDPA].startswith("skipped")
    assert tool.run_size(args, ["loop"], 32768, reported.append)["loop"].startswith("skipped")
    assert tool.run_size(args, ["reference"], 8192, reported.append)["reference"].startswith("skipped")
    monkeypatch.setattr(tool.subprocess, "Popen", real_popen)
    results = tool.run_size(args, ["loop", "unfold"], 64, reported.append)
    assert reported[-1] == results and len(reported) == 4
    seconds, peak, ratio, working, first_call = results["loop"]
    assert seconds > 0 and peak > 0 and ratio >= 1 and working > 0 and first_call > 0
    assert results["unfold"].startswith("failed: The unfold backend does not compute 1D windows; 1D backends:")
