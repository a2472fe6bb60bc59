"""Harmless library warnings are left out at a terminal and kept elsewhere (trial logs, CI)."""

from __future__ import annotations

import io
import sys
import warnings

import pytest

from vramsweep import noise

LIGER = (
    "Backend impl 'liger_kernel.ops.backends._ascend.rope' could not be imported: cannot import name 'tanh' "
    "from 'triton.language.extra.libdevice'"
)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _seen(stderr) -> list[str]:
    saved = sys.stderr
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.stderr = stderr
        try:
            noise.quiet_terminal_warnings()
        finally:
            sys.stderr = saved
        warnings.warn(LIGER, UserWarning, stacklevel=1)
        warnings.warn("something actionable", UserWarning, stacklevel=1)
    return [str(w.message) for w in caught]


@pytest.mark.torchfree
def test_liger_ascend_warning_dropped_at_a_terminal_only():
    assert _seen(_Tty()) == ["something actionable"]
    assert _seen(io.StringIO()) == [LIGER, "something actionable"]  # a log file keeps it


# ------------------------------------------------------------------------------------------------------
# Harmless warnings shown once, repeats counted
# ------------------------------------------------------------------------------------------------------
import logging  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import select  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

#: each filtered warning: a real message it must match, one it must not, and why it is harmless
#: (the `why` text lives beside the pattern in vramsweep.noise.HARMLESS)
SAMPLES = {
    "bnb-cpu-gemm-kernels": (
        "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make "
        "sure you already `pip install kernels` and the kernels >= 0.11.1",
        "Failed to load CPU gemv_4bit",
    ),
    "bnb-int8-fp16-cast": (
        "MatMul8bitLt: inputs will be cast from torch.bfloat16 to float16 during quantization",
        "MatMul8bitLt: something else went wrong",
    ),
    "bnb-paged-optimizer-cpu": (
        "Paged optimizers are not supported on CPU. Falling back to non-paged optimizer behavior.",
        "Paged optimizers ran out of unified memory",
    ),
}


@pytest.mark.torchfree
def test_every_harmless_filter_is_listed_with_why_and_matches_only_its_warning():
    assert {h.key for h in noise.HARMLESS} == set(SAMPLES)
    for h in noise.HARMLESS:
        hit, miss = SAMPLES[h.key]
        assert len(h.why) > 40 and h.line, h.key
        assert noise.WarningDigest.match(hit, h.logger) is h, h.key
        assert noise.WarningDigest.match(miss, h.logger) is None, h.key
        assert noise.WarningDigest.match("an unrelated warning", h.logger) is None


@pytest.mark.torchfree
def test_torchs_autograd_fallback_warning_is_never_filed_as_harmless():
    """It fired when bitsandbytes' CPU-packed 4-bit path cut the gradient (tests/knobs/test_quant_grads.py
    proves it no longer fires): shown as torch wrote it if it ever does."""
    text = (
        "bitsandbytes::gemv_4bit: an autograd kernel was not registered to the Autograd key(s) but we are "
        "trying to backprop through it. This may lead to silently incorrect behavior."
    )
    assert noise.WarningDigest.match(text) is None


def _digest_run(monkeypatch, stderr, tmp_path):
    digest = noise.WarningDigest()
    monkeypatch.setattr(noise, "DIGEST", digest)
    monkeypatch.setattr(sys, "stderr", stderr)
    digest.use_log(tmp_path / "warnings.log")
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    handler = logging.StreamHandler(stderr)
    logger.addHandler(handler)
    logger.propagate = False

    # Python's own printer for what passes (pytest's capture replaces warnings.showwarning in tests)
    def show(message, category, filename, lineno, file=None, line=None):
        stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    monkeypatch.setattr(noise, "_show_original", show)
    noise.install_digest()
    try:
        for _ in range(5):
            logger.warning(
                "MatMul8bitLt: inputs will be cast from %s to float16 during quantization", "torch.bfloat16"
            )
        logger.warning("MatMul8bitLt: a real problem")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = noise._showwarning
            for _ in range(3):
                warnings.warn(SAMPLES["bnb-paged-optimizer-cpu"][0], UserWarning, stacklevel=1)
            warnings.warn("something actionable", UserWarning, stacklevel=1)
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    return digest


@pytest.mark.torchfree
def test_harmless_warnings_once_as_one_line_at_a_terminal_repeats_counted(monkeypatch, tmp_path):
    tty = _Tty()
    digest = _digest_run(monkeypatch, tty, tmp_path)
    lines = tty.getvalue().splitlines()
    shown = [ln for ln in lines if ln.startswith("vramsweep: harmless library warning")]
    assert len(shown) == 2, lines  # the int8 cast once, the paged fallback once
    assert "MatMul8bitLt: a real problem" in lines  # a bitsandbytes line that is not on the list
    assert any("something actionable" in ln for ln in lines)
    assert not any("inputs will be cast" in ln for ln in lines)
    assert digest.counts == {"bnb-int8-fp16-cast": 5, "bnb-paged-optimizer-cpu": 3}
    assert digest.summary() == (
        "vramsweep: harmless library warnings not repeated: bnb-int8-fp16-cast x5, bnb-paged-optimizer-cpu x3"
    )
    log = (tmp_path / "warnings.log").read_text()
    assert "MatMul8bitLt: inputs will be cast from torch.bfloat16" in log and "Paged optimizers" in log


@pytest.mark.torchfree
def test_harmless_warnings_keep_their_full_text_once_in_a_log(monkeypatch, tmp_path):
    out = io.StringIO()
    _digest_run(monkeypatch, out, tmp_path)
    text = out.getvalue()
    assert text.count("MatMul8bitLt: inputs will be cast from torch.bfloat16 to float16") == 1
    assert text.count("UserWarning: Paged optimizers are not supported on CPU") == 1


def _on_a_pty(argv: list[str], cwd: Path, timeout: float) -> str:
    master, slave = os.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, close_fds=True)
    os.close(slave)
    buf = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the pty
                    break
                if not chunk:
                    break
                buf += chunk
            elif proc.poll() is not None:
                break
        proc.wait(timeout=timeout)
    finally:
        os.close(master)
    return buf.decode(errors="replace").replace("\r\n", "\n")


@pytest.mark.slow
@pytest.mark.parametrize(
    "knobs, shown, logged",
    [
        # before: 224 MatMul8bitLt lines and the paged fallback's source line for one step
        (
            "quant=int8 optimizer=paged_adamw_8bit",
            2,
            ["MatMul8bitLt: inputs will be cast", "Paged optimizers"],
        ),
        # torch's "autograd kernel was not registered ... silently incorrect" fired after the initial eval
        # (bitsandbytes' CPU-packed path, which cut the gradient); it is no longer filtered and must not fire
        ("quant=nf4", 0, []),
    ],
    ids=["int8-paged", "nf4"],
)
def test_a_quantised_trial_on_a_terminal_prints_each_harmless_warning_once(tmp_path, knobs, shown, logged):
    """A 3-step quantised trial on a pty: one line per harmless warning, repeats counted, nothing else that
    looks like a warning; the full texts in the run's warnings.log (~1 min each)."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    os.environ["PYTHONPATH"] = os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])
    out = _on_a_pty(
        [sys.executable, "-c", "import sys; from vramsweep.cli import main; sys.exit(main())", "train"]
        + knobs.split()
        + "train.steps=3 train.warmup_steps=0 context.max_tokens=32 "
        "train.micro_batch=1 train.eval_batches=1 train.measure_warmup_steps=0".split(),
        tmp_path,
        timeout=600,
    )
    lines = out.splitlines()
    warned = [
        ln
        for ln in lines
        if re.search(r"warning|MatMul8bitLt|get_state_buffer|autograd kernel|silently", ln, re.I)
    ]
    assert "status: ok" in lines, out[-2000:]
    once = [ln for ln in warned if ln.startswith("vramsweep: harmless library warning (")]
    counted = [ln for ln in warned if ln.startswith("vramsweep: harmless library warnings not repeated: ")]
    assert len(set(once)) == len(once) == (shown if shown is not None else len(once)) <= 2, warned
    assert len(counted) <= 1 and len(warned) == len(once) + len(counted), warned  # nothing else
    if "int8" in knobs:
        assert re.fullmatch(
            r"vramsweep: harmless library warnings not repeated: bnb-int8-fp16-cast x\d+", counted[0]
        )
    if once:
        run = Path(re.search(r"^result: (.+)/result\.json$", out, re.M).group(1))
        log = (tmp_path / run / "warnings.log").read_text()
        assert all(text in log for text in logged), log[-2000:]


BNB_KERNELS = SAMPLES["bnb-cpu-gemm-kernels"][0]


@pytest.mark.torchfree
@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "redirected"])
def test_bnb_kernels_line_never_printed_one_line_in_the_run_log(monkeypatch, tmp_path, terminal):
    """bitsandbytes' "pip install kernels" line is dropped at a terminal and off one (a redirected command,
    a trial log, CI); the run's warnings.log keeps it as one line; lines around it pass."""
    stream = _Tty() if terminal else io.StringIO()
    digest = noise.WarningDigest()
    monkeypatch.setattr(noise, "DIGEST", digest)
    monkeypatch.setattr(sys, "stderr", stream)
    digest.use_log(tmp_path / "warnings.log")
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.propagate = False
    noise.install_digest()
    try:
        for _ in range(3):
            logger.warning(
                "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you "
                "already `pip install kernels` and the kernels >= 0.11.1",
                ModuleNotFoundError("No module named 'kernels'"),
            )
        logger.warning("Failed to load CPU gemv_4bit: a real problem")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    assert stream.getvalue().splitlines() == ["Failed to load CPU gemv_4bit: a real problem"]
    log = (tmp_path / "warnings.log").read_text().splitlines()
    assert len(log) == 1 and "pip install kernels" in log[0], log
    assert digest.summary() is None  # a line never shown is not counted at exit either


def test_bnb_kernels_line_absent_from_a_redirected_command():
    """A real import of bitsandbytes' CPU backend under vramsweep, stderr to a pipe: no kernels line."""
    code = "import vramsweep, bitsandbytes.backends.cpu.ops"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "gemm_4bit_forward" not in out.stdout + out.stderr, out.stderr
    assert BNB_KERNELS.split(":")[0] not in out.stderr
