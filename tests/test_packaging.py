"""The package as pip installs it: a wheel in a fresh virtual environment, used from outside the repository
through its console scripts, ``python -m vil`` and the presets by name."""

import os
import re
import subprocess
import sys

from tool_runner import ROOT


def run(*argv, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but what is installed
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def test_a_wheel_in_a_fresh_environment_trains_the_digits_demo_from_outside_the_repository(tmp_path):
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        tmp_path / "dist",
        ROOT,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("vil-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    # The dependencies come from this environment (a path line only: its editable install of vil is not loaded).
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).stdout.strip()
    here = run(
        sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path
    ).stdout.strip()
    (tmp_path / site / "dependencies.pth").write_text(here + "\n")
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel, cwd=tmp_path)

    assert (tmp_path / site / "vil" / "configs" / "vil_digits.yaml").is_file()
    for script in ("vil-train", "vil-eval", "vil-export", "vil-export-onnx", "vil-benchmark", "vil-make-shards"):
        assert (venv / "bin" / script).is_file(), script
    # One epoch of the digits demo (two of its classes), by preset name; the repository is nowhere on the path.
    # sliding_chunk: the C++ kernel's build is tested elsewhere.
    overrides = [
        "OPTIM.EPOCHS",
        "1",
        "DATA.CLASSES",
        "['0', '1']",
        "DATA.NUM_CLASSES",
        "2",
        "OUTPUT_DIR",
        tmp_path / "run",
        "MODEL.VIT.MSVIT.ATTN_TYPE",
        "sliding_chunk",
    ]
    run(venv / "bin" / "vil-train", "--config-file", "vil_digits", *overrides, cwd=tmp_path)
    assert "epoch 1/1: loss" in (tmp_path / "run" / "log.txt").read_text()


def test_python_m_vil_names_its_commands_and_presets_load_by_name(capsys):
    from vil.__main__ import COMMANDS, main
    from vil.config import load_cfg, preset_config_files

    assert set(preset_config_files()) >= {"vil_tiny", "vil_small", "vil_digits", "vil_medium_deep", "vil_base_wide"}
    assert (
        load_cfg("vil_small").MODEL.VIT.MSVIT.ARCH == load_cfg(ROOT / "configs" / "vil_small.yaml").MODEL.VIT.MSVIT.ARCH
    )
    import pytest

    with pytest.raises(ValueError, match=r"vil_smal .*config file.*preset"):
        load_cfg("vil_smal")
    with pytest.raises(SystemExit, match=r"unknown command 'fit'") as refused:
        main(["fit"])
    assert all(command in str(refused.value) for command in ("train", "eval", "predict", "export-hub", "export"))
    with pytest.raises(SystemExit) as done:  # each command reaches its tool
        main(["export-onnx", "--help"])
    assert done.value.code == 0 and "Export a classification model to ONNX" in capsys.readouterr().out
    # Each command runs the tool of its console script (vil-<command>), which pyproject.toml names.
    scripts = re.findall(r'^vil-([\w-]+) = "vil_tools\.(\w+):main"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert len(scripts) == 8 and all(COMMANDS[command] == module for command, module in scripts), scripts
    main(["--help"])
    listed = capsys.readouterr().out
    assert all(f"  {command} " in listed for command in ("train", "eval", "export-hub", "timm-train"))
    from tool_runner import run_tool

    status, out, _ = run_tool("timm_train", "--help")
    assert status == 0 and "path/to/timm/train.py --model vil_tiny" in out
