"""Flags declared once on the config dataclasses (ditruntime.flags): parse -> config -> argv -> parse
round trips, bad values exit 2 naming the flag, and every parser takes a flag from its one declaration."""

from __future__ import annotations

import argparse
import re
from dataclasses import replace
from pathlib import Path

import pytest
from clikit import CliRunner

from ditcore import validate_checkpoint
from ditruntime.flags import LaunchOptions, add_flags, check_bounds, flag, from_args, to_argv
from ditserve import cli as ditserve_cli
from ditserve.launcher import build_children, child_configs, demo_path, prepare
from generator_service import cli as generator_cli
from generator_service.config import TOKEN_ENV, GeneratorConfig
from plancache_service import cli as plancache_cli
from plancache_service.config import GB, CacheConfig, SidecarConfig

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
CONFIGS = (CacheConfig, SidecarConfig, GeneratorConfig, LaunchOptions)


@pytest.fixture(autouse=True)
def _no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def _serve_parser() -> argparse.ArgumentParser:
    [sub] = [a for a in ditserve_cli._parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser: argparse.ArgumentParser = sub.choices["serve"]
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


# ----------------------------------------------------------------------------- round trips
def _sidecar_config(tmp_path: Path) -> SidecarConfig:
    cache = CacheConfig(gpu_plans=33, plan_width=1, host_cache_bytes=290_000_000, device="cuda:1")
    return SidecarConfig(
        tmp_path / "ckpt", cache, f"unix:{tmp_path / 'run' / 'p.sock'}",
        heartbeat_s=0.25, state_dir=tmp_path / "st", metrics_port=9401,
    )  # fmt: skip


def test_sidecar_round_trip(tmp_path: Path) -> None:
    cfg = _sidecar_config(tmp_path)
    argv = [*to_argv(cfg, exclude=("address",)), "--socket", cfg.address.removeprefix("unix:")]
    assert plancache_cli.config_from_args(plancache_cli.build_parser().parse_args(argv)) == cfg
    # and over TCP
    tls = {"tls_cert": Path("/c.pem"), "tls_key": Path("/k.pem"), "tls_client_ca": Path("/ca.pem")}
    tcp = replace(cfg, address="127.0.0.1:50052", admin_token="t0k-0123456789abcdef", **tls)
    argv = [*to_argv(tcp, exclude=("address",)), "--listen", tcp.address]
    assert plancache_cli.config_from_args(plancache_cli.build_parser().parse_args(argv)) == tcp


@pytest.mark.parametrize(
    "cfg",
    [
        GeneratorConfig(
            sidecar="unix:/run/x/plancache.sock",
            listen="0.0.0.0:1234",
            device="cuda:0",
            max_queue_depth=3,
            max_message_bytes=8 * MIB,
            prefetch=False,
            admin_token="-s3cret-0123456789ab",
            weights_root=Path("/weights"),
            drain_timeout_s=2.5,
            metrics_port=9,
            max_num_frames=141,
            max_height=64,
            max_width=96,
            max_prompt_bytes=100,
            tls_cert=Path("/c.pem"),
            tls_key=Path("/k.pem"),
            tls_client_ca=Path("/ca.pem"),
        ),
        GeneratorConfig(adaln_mode="resident", checkpoint=Path("/ckpt")),
        GeneratorConfig(
            sidecar="10.0.0.2:50052",
            sidecar_tls_ca=Path("/sca.pem"),
            sidecar_tls_cert=Path("/gc.pem"),
            sidecar_tls_key=Path("/gk.pem"),
        ),
    ],
    ids=["cached-everything", "resident", "tcp-sidecar"],
)
def test_generator_round_trip(cfg: GeneratorConfig) -> None:
    args = generator_cli.build_parser().parse_args(to_argv(cfg))
    assert generator_cli.config_from_args(args) == cfg


def test_launch_options_round_trip() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, LaunchOptions)
    cfg = LaunchOptions(run_dir=Path("/r"), log_level="DEBUG", log_format="json", threads=3)
    assert from_args(LaunchOptions, parser.parse_args(to_argv(cfg))) == cfg
    assert from_args(LaunchOptions, parser.parse_args([])) == LaunchOptions()


@pytest.mark.parametrize("cls", CONFIGS[:1] + CONFIGS[3:])
def test_defaults_render_to_nothing(cls: type) -> None:
    assert to_argv(cls()) == []


@pytest.mark.parametrize("nbytes", [0, 1, 290_000_000, 8 * GB + 1, 123_456_789_012])
def test_host_cache_bytes_survive_the_gb_flag(nbytes: int) -> None:
    cfg = CacheConfig(host_cache_bytes=nbytes)
    parser = argparse.ArgumentParser()
    add_flags(parser, CacheConfig)
    assert from_args(CacheConfig, parser.parse_args(to_argv(cfg))) == cfg


def test_parsed_defaults_are_the_dataclass_defaults(tmp_path: Path) -> None:
    sock = tmp_path / "p.sock"
    args = plancache_cli.build_parser().parse_args(["--checkpoint", "ck", "--socket", str(sock)])
    assert plancache_cli.config_from_args(args) == SidecarConfig(Path("ck"), CacheConfig(), f"unix:{sock}")
    args = generator_cli.build_parser().parse_args(["--sidecar", f"unix:{sock}"])
    assert generator_cli.config_from_args(args) == GeneratorConfig(sidecar=f"unix:{sock}")
    # the GB flag's default is the dataclass's byte default
    assert _options(plancache_cli.build_parser())["--host-cache-gb"].default == CacheConfig.host_cache_bytes / GB


def test_admin_token_from_env_stays_off_the_child_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-env-0123456789ab")
    cfg = generator_cli.config_from_args(generator_cli.build_parser().parse_args([]))
    assert cfg.admin_token == "from-env-0123456789ab"
    assert not any("--admin-token" in a for a in to_argv(cfg))
    flagged = generator_cli.config_from_args(
        generator_cli.build_parser().parse_args(["--admin-token", "t2-0123456789abcdef"])
    )
    assert flagged.admin_token == "t2-0123456789abcdef" and "--admin-token=t2-0123456789abcdef" in to_argv(flagged)


def test_to_argv_refuses_a_value_without_a_flag() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        to_argv(GeneratorConfig(sidecar="unix:/s", chunk_bytes=4096))
    with pytest.raises(ValueError, match="address"):
        to_argv(SidecarConfig(Path("ck"), CacheConfig(), "unix:/s"))
    with pytest.raises(ValueError, match="max_message_bytes"):  # not a whole MiB
        to_argv(GeneratorConfig(sidecar="unix:/s", max_message_bytes=MIB + 1))


# ----------------------------------------------------------------------------- serve forwards configs
@pytest.mark.parametrize("mode", ["cached", "resident"])
def test_serve_children_parse_back_to_the_configs(tmp_path: Path, mode: str) -> None:
    argv = ["--run-dir", str(tmp_path), "--checkpoint", str(tmp_path / "ck"), "--adaln-mode", mode]
    argv += ["--gpu-plans", "32", "--host-cache-gb", "0.01", "--max-num-frames", "158", "--device", "cpu"]
    argv += ["--log-format", "json", "--log-level", "DEBUG", "--port", "50071", "--max-queue-depth", "4"]
    args = _serve_parser().parse_args(argv)
    gen, side = child_configs(args, tmp_path, tmp_path / "ck")
    children = build_children(args, from_args(LaunchOptions, args, exclude=("threads",)), gen, side)
    assert [c.name for c in children] == (["plancache sidecar", "generator"] if mode == "cached" else ["generator"])
    gen_args = generator_cli.build_parser().parse_args(children[-1].argv[3:])
    assert generator_cli.config_from_args(gen_args) == gen
    assert (gen.listen, gen.max_num_frames, gen.max_queue_depth, gen.metrics_port) == ("127.0.0.1:50071", 158, 4, 9400)
    for child in children:
        child_args = (
            (plancache_cli if "plancache" in child.name else generator_cli).build_parser().parse_args(child.argv[3:])
        )
        assert from_args(LaunchOptions, child_args).log_format == "json"
        assert from_args(LaunchOptions, child_args).log_level == "DEBUG"
    if side is None:
        assert gen.checkpoint == tmp_path / "ck" and gen.sidecar == ""
        return
    side_args = plancache_cli.build_parser().parse_args(children[0].argv[3:])
    assert plancache_cli.config_from_args(side_args) == side
    assert side.cache == CacheConfig(gpu_plans=32, host_cache_bytes=10_000_000)
    assert (side.state_dir, side.metrics_port) == (tmp_path / "state", 9401)
    assert gen.sidecar == side.address == f"unix:{tmp_path / 'plancache.sock'}"


# ----------------------------------------------------------------------------- serve's demo repository
def test_serve_without_checkpoint_writes_the_tiny_demo_repository_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    demo = demo_path(run_dir)
    run_dir.mkdir(mode=0o700)
    demo.mkdir()
    (demo / "half-written.safetensors").write_bytes(b"x")  # an interrupted write: no model_index.json
    args = _serve_parser().parse_args(["--run-dir", str(run_dir), "--no-metrics"])
    _, checkpoint, children = prepare(args)
    assert checkpoint == demo
    assert not (demo / "half-written.safetensors").exists()
    info = validate_checkpoint(demo)
    assert (info.preset, info.precision, info.has_adaln) == ("tiny", "mixed", True)
    [sidecar, _generator] = children
    assert f"--checkpoint={demo}" in sidecar.argv
    # a second start reuses it, untouched
    stamp = (demo / "model_index.json").stat().st_mtime_ns
    assert prepare(args)[1] == demo
    assert (demo / "model_index.json").stat().st_mtime_ns == stamp


# ----------------------------------------------------------------------------- bad values
CKPT = ["--checkpoint", "/nonexistent"]
BAD_FLAGS: list[tuple[list[str], list[str]]] = [
    (["plancache", *CKPT, "--gpu-plans", "0"], ["--gpu-plans", "[1, 1000000]", "got 0"]),
    (["plancache", *CKPT, "--plan-width", "17"], ["--plan-width", "[1, 16]"]),
    (["plancache", *CKPT, "--host-cache-gb", "-1"], ["--host-cache-gb", ">= 0", "got -1"]),
    (["plancache", *CKPT, "--host-cache-gb", "nan"], ["--host-cache-gb", "finite"]),
    (["plancache", *CKPT, "--heartbeat-s", "100"], ["--heartbeat-s", "[0.05, 60]"]),
    (["plancache", *CKPT, "--threads", "0"], ["--threads", ">= 1"]),
    (["plancache", *CKPT, "--log-format", "xml"], ["--log-format", "invalid choice"]),
    (["generator", "--max-queue-depth", "0"], ["--max-queue-depth", "[1, 100000]"]),
    (["generator", "--max-num-frames", "107"], ["--max-num-frames", "[124, 345]", "got 107"]),
    (["generator", "--max-prompt-bytes", "0"], ["--max-prompt-bytes", "[1, 16384]"]),
    (["generator", "--max-message-mb", "big"], ["--max-message-mb", "invalid int value"]),
    (["generator", "--adaln-mode", "sideways"], ["--adaln-mode", "invalid choice"]),
    # under twice the replica's 30 s keep-alive an idle replica breaks: refused at start, saying why
    (["generator", "--replica-timeout-s", "10"], ["--replica-timeout-s", "at least 60 s", "got 10", "keep-alive"]),
    (["serve", "--replica-timeout-s", "59.5"], ["--replica-timeout-s", "at least 60 s", "got 59.5", "keep-alive"]),
    (["serve", "--gpu-plans", "0"], ["--gpu-plans", "[1, 1000000]"]),
    (["serve", "--host-cache-gb", "inf"], ["--host-cache-gb", "finite"]),
    (["serve", "--max-height", "16"], ["--max-height", "[32, 4096]", "got 16"]),
    (["serve", "--max-width", "8192"], ["--max-width", "[32, 4096]"]),
    (["generate-local", *CKPT, "--gpu-plans", "1000001"], ["--gpu-plans", "[1, 1000000]"]),
    (["generate-local", *CKPT, "--host-cache-gb", "-0.5"], ["--host-cache-gb", ">= 0"]),
]


@pytest.mark.parametrize(("argv", "expect"), BAD_FLAGS, ids=[" ".join(a[0:1] + a[-2:]) for a, _ in BAD_FLAGS])
def test_bad_value_exits_2_naming_the_flag(run_cli: CliRunner, argv: list[str], expect: list[str]) -> None:
    res = run_cli(argv)
    assert res.code == 2, (res.out, res.err)
    last = res.err.strip().splitlines()[-1]
    for s in expect:
        assert s in last, f"{s!r} not in {last!r}"


def test_serve_flag_combination_error_exits_2_before_writing(run_cli: CliRunner, tmp_path: Path) -> None:
    res = run_cli(["serve", "--run-dir", str(tmp_path), "--tls-key", str(tmp_path / "k.pem")])
    assert res.code == 2
    assert "--tls-cert and --tls-key go together" in res.err
    assert list(tmp_path.iterdir()) == []  # no demo checkpoint written


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: CacheConfig(gpu_plans=0), r"gpu_plans \(--gpu-plans\) must be in \[1, 1000000\], got 0"),
        (lambda: CacheConfig(host_cache_bytes=-1), r"host_cache_bytes \(--host-cache-gb\) must be >= 0"),
        (lambda: CacheConfig(device="tpu"), r"--device"),
        (lambda: SidecarConfig(Path("c"), CacheConfig(), "unix:/s", heartbeat_s=0.0), r"--heartbeat-s.*\[0.05, 60\]"),
        (
            lambda: GeneratorConfig(sidecar="unix:/s", max_prompt_bytes=0),
            r"max_prompt_bytes \(--max-prompt-bytes\) must be in \[1, 16384\], got 0",
        ),
        (lambda: GeneratorConfig(sidecar="unix:/s", max_queue_depth=10**6), r"--max-queue-depth.*\[1, 100000\]"),
        (lambda: LaunchOptions(threads=0), r"--threads"),
        (
            lambda: GeneratorConfig(sidecar="unix:/s", replica_timeout_s=float("nan")),
            r"--replica-timeout-s must be at least 60 s, got nan: .*keep-alive, sent every 30 s",
        ),
    ],
)
def test_configs_built_in_code_obey_the_declared_bounds(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()  # type: ignore[operator]


# ----------------------------------------------------------------------------- one declaration
def _declared_flags() -> set[str]:
    names = set()
    for cls in CONFIGS:
        parser = argparse.ArgumentParser(add_help=False)
        add_flags(parser, cls)
        names |= set(_options(parser))
    return names


# Flags with the same name but their own meaning, added by hand on purpose.
OWN_MEANING = {
    "ditserve/launcher.py": {"--checkpoint", "--metrics-port"},  # demo checkpoint by default; P and P+1
    # generate-local's; ditserve's own logging (the admin commands' --allow-plaintext-admin, the consent to send a
    # token without TLS, is in remote.py; the server's flag of that name is its consent to accept one)
    # make-checkpoint --partitions: the partitions to write (the generator's --partitions: those to load)
    "ditserve/cli.py": {"--checkpoint", "--adaln-mode", "--log-level", "--partitions"},
    "plancache_service/cli.py": {"--listen"},  # the sidecar's TCP address (SidecarConfig.address)
    # the client's certificate; the admin commands' consent to send their token without TLS (update-weights,
    # adapters load / unload, audit-quality)
    "ditserve/remote.py": {"--tls-cert", "--tls-key", "--allow-plaintext-admin"},
    "ditserve/bench/runner.py": {"--checkpoint", "--device", "--threads"},  # the benchmark's services
}


def test_no_declared_flag_is_added_by_hand() -> None:
    declared = _declared_flags()
    assert {"--gpu-plans", "--host-cache-gb", "--no-prefetch", "--max-message-mb", "--log-format"} <= declared
    by_hand = re.compile(r"add_argument\(\s*f?[\"'](--[a-z0-9-]+)[\"']")
    for pkg in ("ditserve", "generator_service", "plancache_service", "ditruntime"):
        for path in (REPO / pkg).rglob("*.py"):
            rel = str(path.relative_to(REPO))
            for name in by_hand.findall(path.read_text()):
                assert name not in declared or name in OWN_MEANING.get(rel, ()), f"{rel} adds {name} by hand"


def test_serve_takes_each_child_flag_from_its_declaration() -> None:
    """serve's child flags are the children's own actions: same help, default, choices, declaration."""
    serve = _options(_serve_parser())
    own = {"-h", "--help", "--checkpoint", "--metrics-port", "--port"}  # serve's own meaning
    cases = [
        # serve's --state-dir is the sidecar's declaration: serve hands the same directory to the generator's own
        # --state-dir (its jobs), so the generator's help is not serve's.
        (
            generator_cli.build_parser(),
            own | {"--state-dir"},
            {"--max-num-frames", "--max-prompt-bytes", "--admin-token", "--device", "--log-format", "--run-dir"},
        ),
        # serve's --device / --devices are the generator's declarations (the same devices for both processes); the
        # sidecar's TLS and admin-token flags are not serve's: serve's --tls-* / --admin-token are the generator's, and
        # a TCP sidecar (serve --sidecar-listen) gets the generator's --sidecar-tls-* pair and admin token; serve's
        # --adapter-dir is the generator's, handed to the sidecar too (it builds the adapters' plans).
        (
            plancache_cli.build_parser(),
            own
            | {
                "--device",
                "--devices",
                "--tls-cert",
                "--tls-key",
                "--tls-client-ca",
                "--admin-token",
                "--admin-token-file",
                "--metrics-host",
                "--no-reflection",
                "--adapter-dir",
            },
            {"--gpu-plans", "--plan-width", "--host-cache-gb"},
        ),
    ]
    for child, skip, expected in cases:
        theirs = _options(child)
        shared = (set(serve) & set(theirs)) - skip
        assert expected <= shared
        for name in shared:
            a, b = serve[name], theirs[name]
            assert (a.help, a.default, a.choices, a.dest) == (b.help, b.default, b.choices, b.dest), name
            assert getattr(a.type, "option", None) == getattr(b.type, "option", None), name


def test_flag_declaration_helpers() -> None:
    """A field declared with `flag` is an ordinary dataclass field with a default and metadata."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Demo:
        ratio: float = flag(0.5, "a ratio", low=0, high=1)
        enabled: bool = flag(False, "turn it on")

        def __post_init__(self) -> None:
            check_bounds(self)

    parser = argparse.ArgumentParser()
    add_flags(parser, Demo)
    assert from_args(Demo, parser.parse_args(["--ratio", "0.25", "--enabled"])) == Demo(0.25, True)
    assert to_argv(Demo(0.25, True)) == ["--ratio=0.25", "--enabled"]
    with pytest.raises(ValueError, match=r"ratio \(--ratio\) must be finite and in \[0, 1\], got 2"):
        Demo(ratio=2.0)
