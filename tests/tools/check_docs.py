#!/usr/bin/env python3
"""The docs check: README.md, docs/, bench/README.md and examples/README.md say nothing that fails.

1. Every relative link ([text](path), [text](path#anchor), ![img](path)) names a file or folder
   that exists, and an anchor names a heading of the linked Markdown file (GitHub's slugs).
2. Every shell code block (```sh, ```bash, ```console) carries a mark on the line before it:
       <!-- docs-check: run -->            executed here, as written, in the repository root
       <!-- docs-check: gpu -->            needs a GPU (not run here)
       <!-- docs-check: skip REASON -->    needs what CI lacks: a cluster, ssh, a data set, ...
   An unmarked shell block fails the check, so a new command is either run or said not to be.
   `run` blocks run with bash -e, a file's blocks in order in a scratch copy of the repository
   of their own (every top-level entry linked, so outputs such as OUT/ stay out of the tree), `./build` pointing at the build under
   test and `shardtrain` on PATH; a block that exits non-zero or takes longer than --timeout
   fails the check with its output.
3. `shardtrain train --help` names docs/CONFIG.md.

Usage: check_docs.py --source-dir SRC --build-dir BUILD [--no-run] [--only FILE...]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

SHELL_LANGS = {"sh", "bash", "console", "shell"}
MARK = re.compile(r"<!--\s*docs-check:\s*(run|gpu|skip)\b(.*?)-->")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A line that is a command (not a program's output, whose banner starts "shardtrain 0.1.0 |").
COMMAND = re.compile(r"^\s*(\$\s+)?(\./build/shardtrain|shardtrain (train|launch|compare|report|"
                     r"estimate|generate|export|consolidate|tokenize|pipeline-sim|data-dir)\b|"
                     r"bash |python3? |cmake |mpirun |srun |sbatch |torchrun |examples/)", re.M)
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def doc_files(src):
    files = [os.path.join(src, "README.md")]
    for folder in ("docs", "bench", "examples"):
        root = os.path.join(src, folder)
        for dirpath, _, names in os.walk(root):
            for n in sorted(names):
                if n.endswith(".md"):
                    files.append(os.path.join(dirpath, n))
    return [f for f in files if os.path.exists(f)]


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text, flags=re.UNICODE)
    return text.replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    in_code = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if FENCE.match(line):
                in_code = not in_code
                continue
            m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m and not in_code:
                s = slug(m.group(1))
                n = seen.get(s, 0)
                seen[s] = n + 1
                out.add(s if n == 0 else f"{s}-{n}")
    return out


def blocks(path):
    """(line number, language, mark or None, text) of every fenced block."""
    lines = open(path, encoding="utf-8").read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(m.group(1)):] if lines[i].startswith(m.group(1)) else lines[i])
            i += 1
        i += 1
        mark = None
        j = start - 1
        while j >= 0 and lines[j].strip() == "":
            j -= 1
        if j >= 0:
            mm = MARK.search(lines[j])
            if mm:
                mark = (mm.group(1), mm.group(2).strip())
        out.append((start + 1, lang, mark, "\n".join(body)))
    return out


def link_problems(path, src):
    problems = []
    text = open(path, encoding="utf-8").read()
    # Links inside code blocks are code, not links.
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("mailto:"):
            continue  # http(s):, etc.
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else os.path.normpath(os.path.join(os.path.dirname(path), file_part))
        rel = os.path.relpath(path, src)
        if not os.path.exists(dest):
            problems.append(f"{rel}: link to {target}: {os.path.relpath(dest, src)} does not exist")
            continue
        if not os.path.realpath(dest).startswith(os.path.realpath(src) + os.sep) and dest != path:
            problems.append(f"{rel}: link to {target} leaves the repository")
        if anchor and dest.endswith(".md") and anchor not in anchors(dest):
            problems.append(f"{rel}: link to {target}: no heading with the anchor #{anchor}")
    return problems


def scratch_repo(src, build):
    d = tempfile.mkdtemp(prefix="shardtrain_docs_check_")
    for name in os.listdir(src):
        if name in (".git",) or name.startswith("build"):
            continue
        os.symlink(os.path.join(src, name), os.path.join(d, name))
    os.symlink(os.path.abspath(build), os.path.join(d, "build"))
    return d


def run_block(text, cwd, build, timeout):
    env = dict(os.environ)
    env["PATH"] = os.path.abspath(build) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "2")
    script = "set -e\n" + text.replace("\\\n", " ") + "\n"
    start = time.time()
    try:
        p = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"did not finish within {timeout} s", time.time() - start
    return p.returncode == 0, (p.stdout + p.stderr)[-3000:], time.time() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--no-run", action="store_true", help="check links and marks only")
    ap.add_argument("--only", nargs="*", help="only these Markdown files (paths under the source)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run block")
    args = ap.parse_args()
    src = os.path.abspath(args.source_dir)
    files = doc_files(src)
    if args.only:
        wanted = {os.path.abspath(os.path.join(src, f)) for f in args.only}
        files = [f for f in files if os.path.abspath(f) in wanted]
    problems, to_run = [], []
    counts = {"run": 0, "gpu": 0, "skip": 0}
    for f in files:
        problems += link_problems(f, src)
        for line, lang, mark, text in blocks(f):
            if lang not in SHELL_LANGS:
                # Reports written by `shardtrain compare`/`report` (docs/compare/) list the
                # commands they ran as a record.
                generated = os.path.relpath(f, src).startswith(os.path.join("docs", "compare"))
                if (lang not in ("text", "json", "markdown", "md") and not generated and
                        COMMAND.search(text)):
                    problems.append(f"{os.path.relpath(f, src)}:{line}: a command in a block not "
                                    "marked as shell: open it with ```sh and mark it")
                continue
            rel = f"{os.path.relpath(f, src)}:{line}"
            if mark is None:
                problems.append(f"{rel}: a {lang} block without a <!-- docs-check: run|gpu|skip "
                                "REASON --> mark on the line before it")
                continue
            counts[mark[0]] += 1
            if mark[0] == "skip" and not mark[1]:
                problems.append(f"{rel}: docs-check: skip needs a reason")
            if mark[0] == "run":
                to_run.append((f, rel, text))
    helptext = subprocess.run([os.path.join(args.build_dir, "shardtrain"), "train", "--help"],
                              capture_output=True, text=True).stdout
    if "docs/CONFIG.md" not in helptext:
        problems.append("shardtrain train --help does not name docs/CONFIG.md")
    print(f"{len(files)} files; shell blocks: {counts['run']} run, {counts['gpu']} GPU-only, "
          f"{counts['skip']} skipped", flush=True)
    if not args.no_run:
        scratches = {}  # one per Markdown file: its blocks run in order, in one directory
        try:
            for f, rel, text in to_run:
                if f not in scratches:
                    scratches[f] = scratch_repo(src, args.build_dir)
                ok, out, secs = run_block(text, scratches[f], args.build_dir, args.timeout)
                print(f"  {'ok  ' if ok else 'FAIL'} {rel} ({secs:.0f} s)", flush=True)
                if not ok:
                    problems.append(f"{rel}: the block failed:\n{text}\n--- output (end) ---\n{out}")
        finally:
            for d in scratches.values():
                shutil.rmtree(d, ignore_errors=True)
    for p in problems:
        print("docs check: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
