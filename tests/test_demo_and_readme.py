"""The README's commands and the demo they run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support import forked

ROOT = Path(__file__).resolve().parent.parent


def _block(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- setup:{name} -->\n```\n(.+?)\n```\n<!-- /setup:{name} -->", text, re.S)
    assert match, f"README.md lacks the setup:{name} block"
    return match.group(1)


def test_readme_opens_with_the_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text()
    first_blocks = re.findall(r"```\n(.+?)\n```", text, re.S)[:2]
    assert first_blocks == [_block("demo"), _block("test")]
    assert _block("demo").endswith("python -m dcp_ext demo")
    assert _block("test").endswith("python -m pytest -q")
    assert "setup:test" in (ROOT / ".ci" / "run").read_text()


def test_demo_runs_and_checks_itself(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dcp_ext", "demo", "--width", "512", "--depth", "4",
         "--path", str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "check: model and optimizer shards bit-exact" in out
    assert "equal to the original weights" in out
    assert re.search(r"save: +[\d.]+ s +\([\d.]+ GB/s", out)
    assert out.rstrip().endswith("demo passed")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "dcp_ext.metadata.json"
    ]


def test_ten_line_example_runs_as_is(tmp_path) -> None:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- example:ten-lines -->\n```python\n(.+?)```\n<!-- /example:ten-lines -->", text, re.S)
    assert match, "README.md lacks the example:ten-lines block"
    code = match.group(1)
    assert len(code.strip().splitlines()) <= 11
    # `python -c CODE` in a process forked from the suite's fork server (torch
    # imported once, tests/support/forked.py), not a fresh interpreter: the
    # snippet's own imports, save and error are the same; the README's
    # first command (the demo above) runs as a fresh `python -m dcp_ext`.
    result = forked.run("tests.support.forked:python_c", [code], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "ckpt" / "step1" / "dcp_ext.metadata.json").is_file()
    again = forked.run("tests.support.forked:python_c", [code], cwd=tmp_path)
    assert again.returncode != 0 and "overwrite=True" in again.stderr  # as the README says


def test_single_process_calls_print_nothing_but_the_error(tmp_path) -> None:
    """dcp_ext's wrappers quiet torch's single-process warning and its metadata-fallback traceback."""
    code = (
        "import logging, torch, dcp_ext\n"
        "logging.basicConfig(level=logging.INFO)\n"
        f"root = {str(tmp_path / 'root')!r}\n"
        "m = torch.nn.Linear(4, 4)\n"
        "dcp_ext.save_checkpoint(root, 'a', m)\n"
        "dcp_ext.resume_from_checkpoint(root, m)\n"
        "dcp_ext.save({'w': torch.ones(3)}, root + '/x')\n"
        "dcp_ext.load({'w': torch.ones(3)}, root + '/x')\n"
        "try:\n"
        "    dcp_ext.load({'w': torch.ones(3)}, root)\n"
        "except dcp_ext.NotACheckpointError as e:\n"
        "    print('ERROR', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "is a checkpoint root (partial checkpoints: a)" in result.stdout and "a_partial" in result.stdout
    assert "torch.distributed is disabled" not in result.stderr
    assert "Global metadata is not found" not in result.stderr


def _python_blocks(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def test_every_python_snippet_of_the_readme_and_the_site_parses() -> None:
    """The snippets that cannot run here as they stand (S3 buckets, frameworks'
    trainers) are at least valid Python; the ten-line one above runs."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    checked = 0
    for page in pages:
        for line, code in _python_blocks(page):
            try:
                compile(code, f"{page.relative_to(ROOT)}:{line}", "exec")
            except SyntaxError as e:
                raise AssertionError(f"{page.relative_to(ROOT)} line {line}: {e}") from e
            checked += 1
    assert checked >= 20, checked
