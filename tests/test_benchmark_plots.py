"""The implementation study's plots: one line per backend, log scales, files written whole."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("benchmark_attention", ROOT / "tools" / "benchmark_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_study_draws_time_and_memory(tmp_path, monkeypatch):
    tool = load_tool()
    study = {
        28: {"sdpa (full attention)": (0.03, 50.0, 5.0), "sliding_chunk": (0.05, 90.0, 9.0)},
        56: {"sdpa (full attention)": (0.4, 70.0, 2.0), "sliding_chunk": (0.15, 190.0, 5.0), "reference": "skipped"},
    }
    drawn = []
    import matplotlib.axes

    real_plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, *a, **k: drawn.append((a, k)) or real_plot(self, *a, **k))
    tool.plot_study(study, str(tmp_path / "study"), "title")
    for what in ("time", "memory"):
        data = (tmp_path / f"study_{what}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # Two figures, two lines each (the skipped reference has no point); time in ms, memory in MiB.
    assert [k["label"] for _, k in drawn] == ["sdpa (full attention)", "sliding_chunk"] * 2
    assert drawn[0][0] == ((28, 56), (30.0, 400.0))
    assert drawn[3][0] == ((28, 56), (90.0, 190.0))
    assert not list(tmp_path.glob(".tmp-*"))
