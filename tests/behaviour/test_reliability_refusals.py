"""envbuild's own reliability, as an adversarial user meets it, one command at a time: every
command's bad input (endless or huge files, names the operating system refuses, a second value
that would silently win, an option that would do nothing, dates, image references) is exit 2
with one paragraph and nothing written; a hostile or broken matrix is refused naming its file;
overrides that undo a protection warn. Runs at once and interrupted runs are
tests/process/test_reliability.py."""

from pathlib import Path

import pytest

from conftest import FIXTURE_MATRIX, run_cli
from test_reliability import _listing


BIG = "big.txt"  # 30 MB of zeros, made in the test's directory (a file no command should slurp)

# (command and arguments, words the one-paragraph message must hold). Run in an empty directory
# (plus BIG, req.txt and mine.yml where named): afterwards it holds nothing new.
BAD_INPUT = [
    # endless or huge files a user names: refused at a bound, not after the memory is gone
    (["render", "--gpu", "h20", "--ca-cert", "/dev/zero"], ["--ca-cert /dev/zero is a character device, not a regular"]),
    (["render", "--gpu", "h20", "--ca-cert", BIG], ["--ca-cert big.txt is larger than"]),
    (["extend", "--gpu", "h100", "-r", "/dev/zero"], ["-r /dev/zero is a character device"]),
    (["extend", "--gpu", "h100", "-r", BIG], ["-r big.txt is larger than 2 MiB"]),
    (["extend", "--gpu", "h100", "-f", "/dev/zero"], ["-f /dev/zero is a character device"]),
    (["extend", "--gpu", "h100", "-f", BIG], ["-f big.txt is larger than 1 MiB"]),
    (["readme-tables", "--check", "/dev/zero"], ["/dev/zero is a character device"]),
    # names the operating system refuses: exit 2, not "internal error"
    (["render", "--gpu", "h20", "-o", "x" * 300], ["cannot be written", "File name too long"]),
    (["ci", "-o", ""], ["-o/--output '' names no file"]),
    (["ci", "-o", "out/"], ["names no file"]),
    (["ci", "-o", "/proc/ci.yml"], ["/proc/ci.yml cannot be written"]),
    (["ci", "-o", "matrix-refresh.yml"], ["the refresh workflow"]),
    # a file envbuild did not write is never replaced
    (["ci", "-o", "mine.yml"], ["mine.yml exists and envbuild did not write it", "nothing was written"]),
    # a second value would silently win
    (["render", "--gpu", "h100", "--gpu", "h20"], ["--gpu is given 2 times (h100, h20)"]),
    (["render", "--gpu", "h20", "--stack", "a", "--stack", "b"], ["--stack is given 2 times"]),
    (["extend", "--gpu", "h100", "--gpu", "h20", "-r", "req.txt"], ["--gpu is given 2 times"]),
    # an option that would do nothing
    (["render", "--gpu", "h100", "--qemu"], ["--qemu builds an arm64 image", "rule qemu", "gh200"]),
    # dates: not a date, or a day that has not come
    (["extend", "--gpu", "h100", "-r", "req.txt", "--as-of", "2026-13-01"], ["--as-of '2026-13-01' is not a calendar date"]),
    (["extend", "--gpu", "h100", "-r", "req.txt", "--as-of", "2099-01-01"], ["--as-of 2099-01-01 is in the future"]),
    # --from: an image reference, checked before Docker or uv is asked anything
    (["extend", "--gpu", "h100", "-r", "req.txt", "--from", "not a ref!"], ["--from 'not a ref!' is not a valid image"]),
]


def _bad_input_dir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    with open(work / BIG, "wb") as f:
        f.truncate(30 * 1024 * 1024)
    (work / "req.txt").write_text("einops\n")
    (work / "mine.yml").write_text("on: push\n")
    return work


def assert_clean_failure(r, words):
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    both = r.stderr + r.stdout
    assert "Traceback" not in both and "internal error" not in both
    msg = r.stderr.strip()
    assert msg.startswith("envbuild: error:"), msg
    assert "\n\n" not in msg
    for w in words:
        assert w in " ".join(msg.split()), (w, msg)


@pytest.mark.parametrize("args, words", BAD_INPUT, ids=[" ".join(a)[:60] for a, _ in BAD_INPUT])
def test_bad_input_is_exit_2_one_paragraph_nothing_written(tmp_path, args, words):
    work = _bad_input_dir(tmp_path)
    before = _listing(work)
    r = run_cli(*args, cwd=work, timeout=60)
    assert_clean_failure(r, words)
    assert _listing(work) == before


def test_a_utf16_or_binary_matrix_file_is_refused(cli, matrix_copy, tmp_path):
    for data, words in [("stacks: []".encode("utf-16"), ["is not UTF-8 text", "UTF-16"]),
                        (bytes(range(256)), ["is not UTF-8 text"])]:
        (matrix_copy / "stacks.yaml").write_bytes(data)
        r = cli("render", "--gpu", "h20", "--matrix-dir", str(matrix_copy), "-o", str(tmp_path / "o"))
        assert_clean_failure(r, [str(matrix_copy / "stacks.yaml"), *words])
        assert not (tmp_path / "o").exists()


def test_a_newline_in_a_matrix_env_value_is_refused_not_rendered_as_an_instruction(cli, matrix_copy, tmp_path):
    p = matrix_copy / "gpus.yaml"
    text = p.read_text()
    i = text.index("common_env:")
    j = text.index("value: ", i)
    end = text.index("\n", j)
    p.write_text(text[:j] + 'value: "1\\nRUN echo injected"' + text[end:])
    r = cli("render", "--gpu", "h20", "--matrix-dir", str(matrix_copy), "-o", str(tmp_path / "o"))
    assert_clean_failure(r, ["common_env[0]", "control character", "one line of text"])


def test_two_gpu_profiles_with_one_name_are_refused(cli, matrix_copy, tmp_path):
    p = matrix_copy / "gpus.yaml"
    text = p.read_text()
    assert "  - {name: h100, aliases: [" in text
    p.write_text(text.replace("  - {name: h100, aliases: [", "  - {name: h20, aliases: [h100-x, ", 1))
    r = cli("render", "--gpu", "h20", "--matrix-dir", str(matrix_copy), "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and "two profiles are named 'h20'" in r.stderr, r.stderr


def test_overrides_that_undo_a_protection_warn(cli, tmp_path):
    r = cli("render", "--gpu", "h20", "-o", str(tmp_path / "o"), "--env", "PIP_CONSTRAINT=", "--env",
            "UV_CONSTRAINT=/dev/null", "--env", "ENVBUILD_MIN_DRIVER=1", "--env", "NVIDIA_VISIBLE_DEVICES=none")
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stderr.split())
    for words in ["--env PIP_CONSTRAINT= replaces the guard", "--env UV_CONSTRAINT=/dev/null replaces the guard",
                  "--env ENVBUILD_MIN_DRIVER=1 changes the driver floor",
                  "--env NVIDIA_VISIBLE_DEVICES=none bakes which GPUs", "without GPUs"]:
        assert words in said, (words, said)


def test_ci_replaces_only_the_workflows_it_wrote(cli, tmp_path):
    wf = tmp_path / "wf"
    assert cli("ci", "-o", str(wf / "publish.yml")).returncode == 0
    assert cli("ci", "-o", str(wf / "publish.yml")).stdout.count("unchanged") == 2
    (wf / "matrix-refresh.yml").write_text("on: push  # mine\n")
    before = _listing(wf)
    r = cli("ci", "-o", str(wf / "publish.yml"))
    assert_clean_failure(r, ["matrix-refresh.yml exists and envbuild did not write it"])
    assert _listing(wf) == before  # checked before anything is written: publish.yml untouched too


def test_matrix_wide_is_readable_in_80_columns_and_in_a_pipe(cli):
    for env in ({"COLUMNS": "80"}, {}):
        r = run_cli("matrix", "--wide", env=env)
        assert r.returncode == 0
        header = next(line for line in r.stdout.splitlines() if "stack" in line and "python" in line)
        assert "torchvision" in header and "deepspeed" in header, header


def test_unknown_gpu_names_the_matrix_file_read(cli, matrix_copy, tmp_path):
    r = cli("render", "--gpu", "zz9000", "--matrix-dir", str(matrix_copy), "-o", str(tmp_path / "o"))
    assert_clean_failure(r, [f"a profile in {matrix_copy / 'gpus.yaml'}"])


def test_lock_refuses_to_write_into_the_installed_copy_of_the_matrix(tmp_path, monkeypatch):
    from envbuild.base import resources
    assert not resources.is_installed_copy(FIXTURE_MATRIX)
    monkeypatch.setattr(resources, "_PKG", tmp_path / "site-packages" / "envbuild")
    (tmp_path / "site-packages" / "envbuild" / "matrices").mkdir(parents=True)
    assert resources.is_installed_copy(tmp_path / "site-packages" / "envbuild" / "matrices")
