"""Every directory flag is created with mode 0700 when missing (parents too) or refused at startup with a message
naming the flag: `--state-dir`, `--run-dir` / `--socket`'s directory, `--out`; an input directory (`--weights-root`)
must exist. Nothing starts (no server, no request) when one is refused.

Only what was created is chmod-ed: an existing private directory (`--run-dir`, `--socket`'s directory) open to
group/other is refused naming the flag, its mode and the fix, and left as it was (`--socket ~/x.sock` must not chmod
$HOME); an existing `--state-dir` / `--out` may be shared (a volume root) and is used as it is."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from clikit import run_cli_inprocess

from ditruntime.paths import DirectoryFlagError, ensure_private_dir, prepare_dir, require_dir
from plancache_service.app import build_server
from plancache_service.cli import build_parser, config_from_args
from plancache_service.state import STATE_FILE


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_missing_directories_are_created_0700_parents_too(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        got = prepare_dir(tmp_path / "a" / "b" / "c", "--state-dir")
    finally:
        os.umask(old)
    assert got == tmp_path / "a" / "b" / "c" and got.is_dir()
    assert [_mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    assert prepare_dir(got, "--state-dir") == got  # an existing directory is accepted as it is


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o705, 0o770, 0o701, 0o1777])
def test_an_existing_private_dir_open_to_others_is_refused_and_left_as_it_is(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "home"
    shared.mkdir()
    shared.chmod(mode)
    want = (
        f"^--socket {shared}: the directory has mode {stat.S_IMODE(mode):04o}, open to group/other; it must be "
        f"private \\(0700\\): run `chmod 700 {shared}` if only this user should use it, or choose another directory$"
    )
    with pytest.raises(DirectoryFlagError, match=want):
        ensure_private_dir(shared, "--socket")
    with pytest.raises(DirectoryFlagError, match=r"^--run-dir .*: the directory has mode"):
        prepare_dir(shared, "--run-dir", private=True)
    assert _mode(shared) == stat.S_IMODE(mode), "an existing directory was chmod-ed"


def test_a_private_dir_is_created_0700_inside_a_shared_parent_which_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    old = os.umask(0o000)
    try:
        got = ensure_private_dir(shared / "run" / "sock.d", "--socket")
    finally:
        os.umask(old)
    assert [_mode(p) for p in (shared / "run", got)] == [0o700, 0o700] and _mode(shared) == 0o755
    assert ensure_private_dir(got, "--socket") == got and _mode(got) == 0o700  # existing and private: accepted


def test_existing_state_and_out_dirs_may_be_shared_and_keep_their_mode(tmp_path: Path) -> None:
    """A volume's root (Kubernetes fsGroup: group-writable, setgid) is a legitimate --state-dir; never chmod-ed."""
    volume = tmp_path / "volume"
    volume.mkdir()
    volume.chmod(0o2775)
    assert prepare_dir(volume, "--state-dir") == volume and prepare_dir(volume, "--out") == volume
    assert stat.S_IMODE(volume.stat().st_mode) == 0o2775


def test_the_sidecar_refuses_a_socket_dir_open_to_others_before_starting(tiny_ckpt: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    res = run_cli_inprocess(["plancache", "--checkpoint", tiny_ckpt, "--socket", home / "x.sock"])
    assert res.code == 2, res.err
    assert f"--socket {home}: the directory has mode 0755" in res.err and f"chmod 700 {home}" in res.err
    assert _mode(home) == 0o755 and not (home / "x.sock").exists()


def test_serve_refuses_a_run_dir_open_to_others_before_starting_anything(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o750)
    res = run_cli_inprocess(["serve", "--run-dir", run])
    assert res.code == 2 and f"--run-dir {run}: the directory has mode 0750" in res.err, res.err
    assert _mode(run) == 0o750 and list(run.iterdir()) == []


def test_a_file_or_a_file_parent_is_refused_naming_the_flag(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DirectoryFlagError, match=f"^--state-dir {f}: the path exists and is not a directory"):
        prepare_dir(f, "--state-dir")
    with pytest.raises(DirectoryFlagError, match=f"^--out {f / 'sub'}: its parent {f} exists and is not a directory"):
        prepare_dir(f / "sub", "--out")
    with pytest.raises(DirectoryFlagError, match=r"^--weights-root .*: no such directory"):
        require_dir(tmp_path / "absent", "--weights-root")
    with pytest.raises(DirectoryFlagError, match=r"^--weights-root .*: exists and is not a directory"):
        require_dir(f, "--weights-root")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any mode")
def test_an_unwritable_directory_is_refused_naming_the_flag(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        with pytest.raises(DirectoryFlagError, match=f"^--state-dir {ro}: the directory is not writable"):
            prepare_dir(ro, "--state-dir")
        with pytest.raises(DirectoryFlagError, match=f"^--state-dir {ro / 'new'}: cannot create {ro / 'new'}"):
            prepare_dir(ro / "new", "--state-dir")
    finally:
        ro.chmod(0o700)


def test_an_unwritable_directory_is_refused_even_where_modes_do_not_bind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As root (CI containers) no mode stops a write; the refusal itself is checked through os.access."""
    monkeypatch.setattr(os, "access", lambda *_a, **_k: False)
    with pytest.raises(DirectoryFlagError, match=f"^--state-dir {tmp_path}: the directory is not writable"):
        prepare_dir(tmp_path, "--state-dir")


def test_the_sidecar_creates_a_missing_state_dir(tiny_ckpt: Path, tmp_path: Path) -> None:
    state_dir = tmp_path / "not" / "yet" / "state"
    sock = tmp_path / "run" / "plancache.sock"
    args = build_parser().parse_args(
        ["--checkpoint", str(tiny_ckpt), "--state-dir", str(state_dir), "--socket", str(sock), "--host-cache-gb", "0"]
    )
    server = build_server(config_from_args(args))
    try:
        assert state_dir.is_dir() and _mode(state_dir) == 0o700 and (state_dir / STATE_FILE).exists()
        assert _mode(tmp_path / "not") == 0o700 and _mode(sock.parent) == 0o700
    finally:
        server.stop(0)


def test_the_sidecar_refuses_a_state_dir_that_is_a_file(tiny_ckpt: Path, tmp_path: Path) -> None:
    f = tmp_path / "state"
    f.write_text("not a directory")
    res = run_cli_inprocess(
        ["plancache", "--checkpoint", tiny_ckpt, "--state-dir", f, "--socket", tmp_path / "run" / "s.sock"]
    )
    assert res.code == 2
    assert f"ditserve plancache: error: --state-dir {f}: the path exists and is not a directory" in res.err
    assert not (tmp_path / "run" / "s.sock").exists()


def test_the_sidecar_refuses_a_socket_directory_that_is_a_file(tiny_ckpt: Path, tmp_path: Path) -> None:
    f = tmp_path / "run"
    f.write_text("x")
    res = run_cli_inprocess(["plancache", "--checkpoint", tiny_ckpt, "--socket", f / "s.sock"])
    assert res.code == 2 and f"--socket {f}: the path exists and is not a directory" in res.err


def test_serve_refuses_a_bad_state_dir_before_starting_anything(tmp_path: Path) -> None:
    f = tmp_path / "state"
    f.write_text("x")
    res = run_cli_inprocess(["serve", "--run-dir", tmp_path / "run", "--state-dir", f])
    assert (
        res.code == 2 and f"ditserve serve: error: --state-dir {f}: the path exists and is not a directory" in res.err
    )
    assert not (tmp_path / "run" / "plancache.log").exists()


def test_serve_refuses_a_run_dir_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "run"
    f.write_text("x")
    res = run_cli_inprocess(["serve", "--run-dir", f])
    assert res.code == 2 and f"--run-dir {f}: the path exists and is not a directory" in res.err


def test_the_generator_refuses_a_missing_weights_root(tmp_path: Path) -> None:
    res = run_cli_inprocess(["generator", "--weights-root", tmp_path / "absent", "--sidecar", tmp_path / "s.sock"])
    assert res.code == 2 and f"--weights-root {tmp_path / 'absent'}: no such directory" in res.err


def test_generate_local_refuses_an_out_file_before_running(tmp_path: Path) -> None:
    f = tmp_path / "out"
    f.write_text("x")
    res = run_cli_inprocess(
        [
            "generate-local",
            "--checkpoint",
            tmp_path / "none",
            "--adaln-mode",
            "resident",
            "--prompt",
            "p",
            "--out",
            f / "d",
        ]
    )
    assert res.code == 2 and f"--out {f / 'd'}: its parent {f} exists and is not a directory" in res.err
    assert res.out == ""


def test_generate_refuses_an_out_under_a_file_before_any_call(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    res = run_cli_inprocess(["generate", "--target", "127.0.0.1:1", "--prompt", "p", "--out", f / "results"])
    assert res.code == 2 and f"--out {f / 'results'}: its parent {f} exists and is not a directory" in res.err


def test_generate_local_creates_a_missing_out_dir_0700_at_the_first_result(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "a" / "results"
    small = ["--num-inference-steps", "2", "--height", "32", "--width", "32", "--num-frames", "124"]
    res = run_cli_inprocess(
        ["generate-local", "--checkpoint", tiny_ckpt, "--adaln-mode", "resident", "--prompt", "p", "--out", out, *small]
    )
    assert res.code == 0, res.err
    assert out.is_dir() and _mode(out) == 0o700 and _mode(tmp_path / "a") == 0o700
    assert [p.name for p in out.iterdir()] == ["req-0.safetensors"]
