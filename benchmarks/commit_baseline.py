"""Run a benchmark script as it was at another commit, for old-against-new figures in one
invocation (`--baseline-commit REV` in throughput.py and prefix_cache.py).

The commit is checked out into a temporary git worktree and its own copy of the script runs
there in a subprocess with the same arguments; the script puts its tree first on sys.path, so
it imports that commit's pagedlm. The figures come back through the script's --output-json.
"""
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script_at_commit(rev: str, script: str, argv: list[str]) -> dict:
    """script: a path relative to the repository root; argv: its arguments (no output json)."""
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--verify", f"{rev}^{{commit}}"],
                         check=True, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="pagedlm-baseline-") as tmp:
        tree = os.path.join(tmp, "tree")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-q", tree, sha],
                       check=True)
        try:
            out = os.path.join(tmp, "figures.json")
            print(f"--- baseline: {script} at {rev} ({sha[:10]}) ---", flush=True)
            subprocess.run([sys.executable, os.path.join(tree, script), *argv,
                            "--output-json", out], check=True, cwd=tree)
            print(f"--- end of baseline at {sha[:10]} ---", flush=True)
            with open(out) as f:
                figures = json.load(f)
            figures["commit"] = sha
            return figures
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree],
                           check=False)


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
