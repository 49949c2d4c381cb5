"""Run a benchmark script in a fresh process, as it is (`run_script_fresh`) or as it was at
another commit (`run_script_at_commit`, for `--baseline-commit REV` in throughput.py and
prefix_cache.py), and read its figures back through the script's --output-json.

Why every compared run gets its own process: engines built one after another in one process
ran the same requests in 37.0, 58.5, 45.5 and 61.9 s (forward time; last session's
/tmp/order.py), far more than the differences being measured. In fresh processes that spread
goes away, so a figure never depends on what ran before it in the same interpreter.

For a commit, it is checked out into a temporary git worktree and its own copy of the script
runs there. Every leg runs with its tree first on PYTHONPATH, so it imports that tree's pagedlm
and not the one installed in editable mode (this tree's): scripts of older commits also put their
tree first on sys.path themselves, newer ones rely on this. A script that records where it
imported pagedlm from (throughput.py: config.pagedlm_path) is checked against its tree.
"""
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script_at_commit(rev: str, script: str, argv: list[str]) -> dict:
    """script: a path relative to the repository root; argv: its arguments (no output json)."""
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--verify", f"{rev}^{{commit}}"],
                         check=True, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="pagedlm-baseline-") as tmp:
        tree = os.path.join(tmp, "tree")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-q", tree, sha],
                       check=True)
        try:
            print(f"--- baseline: {script} at {rev} ({sha[:10]}) ---", flush=True)
            figures = _run(tree, script, argv, tmp)
            print(f"--- end of baseline at {sha[:10]} ---", flush=True)
            figures["commit"] = sha
            return figures
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree],
                           check=False)


def run_script_fresh(script: str, argv: list[str]) -> dict:
    """script (relative to the repository root) from this tree, in a new interpreter."""
    with tempfile.TemporaryDirectory(prefix="pagedlm-leg-") as tmp:
        return _run(REPO, script, argv, tmp)


def _run(tree: str, script: str, argv: list[str], tmp: str) -> dict:
    out = os.path.join(tmp, "figures.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    subprocess.run([sys.executable, os.path.join(tree, script), *argv, "--output-json", out],
                   check=True, cwd=tree, env=env)
    with open(out) as f:
        figures = json.load(f)
    imported = figures.get("config", {}).get("pagedlm_path")
    expected = os.path.join(os.path.realpath(tree), "pagedlm")
    if imported is not None and os.path.realpath(imported) != expected:
        raise RuntimeError(f"{script} in {tree} imported pagedlm from {imported}, not from its "
                           f"own tree ({expected}): its figures would be another tree's")
    return figures


def strip_option(argv: list[str], name: str) -> list[str]:
    """argv without `name VALUE` / `name=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def strip_flag(argv: list[str], name: str) -> list[str]:
    """argv without the valueless flag `name`."""
    return [a for a in argv if a != name]
