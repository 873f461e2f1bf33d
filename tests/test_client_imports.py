"""The client side starts without the model: each client path, run in a fresh interpreter, loads no torch, no
diffusers, no service and no part of ditcore but the request rules (issue 33: a client that starts at once).

Each case runs its code in `python -c` and prints the forbidden modules it finds in `sys.modules` afterwards; the
command paths run `ditserve.cli.main` to the end against an unreachable target, so the client is built and used.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1: the client's first call fails at once (UNAVAILABLE)
REQUEST_RULES = frozenset({"request", "keyframes", "references", "reference_decode", "media", "media_cache", "report"})
"""ditcore's torch-free modules: the request rules and the probes they call (ditcore/__init__.py)."""

REPORT = """
import json, sys
def forbidden(name):
    root, _, rest = name.partition(".")
    if root in ("torch", "diffusers", "transformers", "generator_service", "plancache_service"):
        return True
    return root == "ditcore" and rest != "" and rest.split(".")[0] not in REQUEST_RULES
print(json.dumps({"rc": RC, "loaded": sorted(m for m in sys.modules if forbidden(m))}))
"""


def _run(code: str, rc: str = "None") -> dict[str, object]:
    script = f"REQUEST_RULES = {sorted(REQUEST_RULES)!r}\n{code}\n{REPORT.replace('RC', rc)}"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    report: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize(
    "module", ["ditserve.client", "ditserve.jobs_client", "ditserve.cli", "ditserve.openai.app", "ditcore"]
)
def test_a_client_module_imports_no_model(module: str) -> None:
    assert _run(f"import {module}")["loaded"] == []


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--target", UNREACHABLE, "--prompt", "a red fox"],
        ["jobs", "list", "--target", UNREACHABLE],
        ["jobs", "cancel", "--target", UNREACHABLE, "job_" + "0" * 32],
        ["jobs", "create", "--target", UNREACHABLE, "--prompt", "a red fox"],
        ["update-weights", "--target", UNREACHABLE, "--path", "/weights/B", "--token", "t" * 24],
        ["status", "--target", UNREACHABLE, "--timeout-s", "2"],
        ["quality-levels", "--target", UNREACHABLE, "--timeout-s", "2"],
        ["audit-quality", "--target", UNREACHABLE, "--level", "l", "--requests", __file__, "--audit-dir", "/none"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_a_client_command_runs_without_the_model(argv: list[str]) -> None:
    report = _run(f"from ditserve.cli import main\nrc = main({argv!r})", rc="rc")
    assert report == {"rc": 1, "loaded": []}  # 1: it reached the (unreachable) server


def test_the_facade_command_builds_its_app_without_the_model() -> None:
    code = (
        "import uvicorn\nserved = []\nuvicorn.run = lambda app, **kw: served.append(app)\n"
        f"from ditserve.cli import main\nrc = main(['openai-api', '--target', {UNREACHABLE!r}])\nassert served"
    )
    assert _run(code, rc="rc") == {"rc": 0, "loaded": []}


def test_a_local_command_still_loads_the_model() -> None:
    """The check above can fail: a local command's path loads torch (and the model layer) as it must."""
    report = _run("from ditserve.cli import main\nrc = main(['inspect', '--preset', 'tiny', '--json'])", rc="rc")
    assert report["rc"] == 0
    loaded = report["loaded"]
    assert isinstance(loaded, list) and "torch" in loaded and "ditcore.presets" in loaded


def test_every_error_the_command_line_maps_is_a_real_class() -> None:
    """cli names the errors it maps (so a client command need not import the model's): each name must resolve."""
    import importlib

    from ditserve import cli

    for name in (*cli.USAGE_ERRORS, *cli.FAILURES):
        module, cls = name.split(":")
        assert issubclass(getattr(importlib.import_module(module), cls), Exception), name
    assert len(cli._loaded(cli.USAGE_ERRORS)) == len(cli.USAGE_ERRORS)


def test_the_model_layer_still_exports_its_names() -> None:
    """`from ditcore import X` keeps working for the server side: every exported name resolves to its module's."""
    import ditcore

    assert sorted(ditcore._SOURCES) == sorted(ditcore.__all__)
    for name, source in ditcore._SOURCES.items():
        assert getattr(ditcore, name) is getattr(sys.modules[f"ditcore.{source}"], name)
    with pytest.raises(AttributeError, match="no_such_name"):
        ditcore.no_such_name  # noqa: B018
