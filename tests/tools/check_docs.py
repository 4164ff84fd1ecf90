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
4. The block right after a `run` block, when it shows a training banner ("shardtrain 0.1.0 |
   train ..."), is that command's real output: each of its lines before the first step line
   (`epoch N | step ...`) must equal the line of the same kind (the banner's head, `  batch:`,
   `  steps:`, `dropout:`, `placement (...)`, `warning:` ...) that the binary printed when the
   check ran the block, timings ("loaded in 0.3 s") and the thread count ("cpu (2 threads)")
   aside. A doc may leave lines out; what it shows must be what the binary prints now. No extra
   runs: the run block's own output is used. The token cache's "data: tokenizing ..." lines
   (first run only) are not compared.

Usage: check_docs.py --source-dir SRC --build-dir BUILD [--no-run]
                     [--only FILE... | --exclude FILE...]

--only and --exclude split the check by document (the files' run blocks are independent: each
file runs in a scratch directory of its own), so that CTest runs the parts side by side and each
block once (tests/CMakeLists.txt). Check 3 belongs to the part without --only.
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
# The banner `shardtrain train` prints before its first step (src/train/trainer.cpp print_banner,
# image_trainer.cpp), and the step lines that end it.
BANNER_HEAD = re.compile(r"^shardtrain \S+ \| train ")
STEP_LINE = re.compile(r"^epoch \d+ (\(partial\) )?\| (step|\d+ steps)")
# First-run lines of the token cache: present or not depending on ~/.cache/shardtrain.
CACHE_LINE = re.compile(r"^data: (tokenizing |\d+ tokens in )")
TIMING = re.compile(r"\b(loaded in|tokens in) \d+(\.\d+)? s\b")
# The machine, not the code: OpenMP threads per rank follow the cores and OMP_NUM_THREADS.
THREADS = re.compile(r"\bcpu \(\d+ threads\)")


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


def banner_kind(line):
    """What a pre-step line is, to pair a doc's line with the binary's: the banner's head, or the
    text before the first ':' with its indentation ("  batch", "placement (--offload auto)")."""
    if BANNER_HEAD.match(line):
        return "shardtrain | train"
    head = line.split(":", 1)[0]
    return head if ":" in line else line


def normalized(line):
    line = TIMING.sub(lambda m: m.group(1) + " <time> s", line.rstrip())
    return THREADS.sub("cpu (<n> threads)", line)


def pre_step_sections(output):
    """Each banner's pre-step lines in a command's output: from the end of the previous section
    (or the start) to the first step line after its head."""
    lines = output.split("\n")
    sections, start, i = [], 0, 0
    while i < len(lines):
        if BANNER_HEAD.match(lines[i]):
            j = i
            while j < len(lines) and not STEP_LINE.match(lines[j]):
                j += 1
            sections.append(lines[start:j])
            start = i = j
        i += 1
    return sections


def banner_problems(doc_rel, doc_line, doc_text, output):
    """How a doc block of real output differs from `output` in the lines before its first step.
    doc_line: the line number of the block's opening fence."""
    doc_lines = []
    for k, line in enumerate(doc_text.split("\n")):
        if STEP_LINE.match(line):
            break
        if line.strip() and not CACHE_LINE.match(line):
            doc_lines.append((doc_line + 1 + k, line))
    heads = [l for _, l in doc_lines if BANNER_HEAD.match(l)]
    sections = pre_step_sections(output)
    if not sections:
        return [f"{doc_rel}:{doc_line}: shows a banner, but the command printed none"]
    # The section whose head the doc shows (a block may run several commands), else the first.
    section = sections[0]
    for sec in sections:
        if heads and any(normalized(l) == normalized(heads[0]) for l in sec):
            section = sec
    by_kind = {}
    for line in section:
        by_kind.setdefault(banner_kind(line), []).append(line)
    problems = []
    for number, line in doc_lines:
        printed = by_kind.get(banner_kind(line), [])
        if any(normalized(p) == normalized(line) for p in printed):
            continue
        problems.append(f"{doc_rel}:{number}: the banner line differs from what the binary "
                        f"prints now\n  doc:    {line.rstrip()}\n  binary: "
                        + (printed[0].rstrip() if printed else "(no such line)"))
    return problems


def run_block(text, cwd, build, timeout):
    env = dict(os.environ)
    env["PATH"] = os.path.abspath(build) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "2")
    script = "set -e\n" + text.replace("\\\n", " ") + "\n"
    start = time.time()
    try:
        p = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"did not finish within {timeout} s", time.time() - start
    return p.returncode == 0, p.stdout, time.time() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--no-run", action="store_true", help="check links and marks only")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--only", nargs="*",
                       help="only these Markdown files (paths under the source)")
    which.add_argument("--exclude", nargs="*", help="every Markdown file but these")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run block")
    args = ap.parse_args()
    src = os.path.abspath(args.source_dir)
    files = doc_files(src)
    for names, keep in ((args.only, True), (args.exclude, False)):
        if names is None:
            continue
        named = {os.path.abspath(os.path.join(src, f)) for f in names}
        missing = [f for f in names if os.path.abspath(os.path.join(src, f)) not in
                   {os.path.abspath(g) for g in files}]
        if missing:  # a renamed or removed document: its part of the check would silently vanish
            print(f"docs check: not a checked document: {', '.join(missing)}", file=sys.stderr)
            return 2
        files = [f for f in files if (os.path.abspath(f) in named) == keep]
    problems, to_run = [], []
    counts = {"run": 0, "gpu": 0, "skip": 0}
    for f in files:
        problems += link_problems(f, src)
        after_run = None  # the run block just before this one, if it is the previous block
        for line, lang, mark, text in blocks(f):
            previous_run, after_run = after_run, None
            if lang not in SHELL_LANGS:
                if previous_run is not None and any(BANNER_HEAD.match(l) for l in text.split("\n")):
                    previous_run[3].append((line, text))  # its real output, with a banner
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
                to_run.append((f, rel, text, []))
                after_run = to_run[-1]
    if args.only is None:
        helptext = subprocess.run([os.path.join(args.build_dir, "shardtrain"), "train", "--help"],
                                  capture_output=True, text=True).stdout
        if "docs/CONFIG.md" not in helptext:
            problems.append("shardtrain train --help does not name docs/CONFIG.md")
    print(f"{len(files)} files; shell blocks: {counts['run']} run, {counts['gpu']} GPU-only, "
          f"{counts['skip']} skipped", flush=True)
    if not args.no_run:
        scratches = {}  # one per Markdown file: its blocks run in order, in one directory
        try:
            for f, rel, text, outputs in to_run:
                if f not in scratches:
                    scratches[f] = scratch_repo(src, args.build_dir)
                ok, out, secs = run_block(text, scratches[f], args.build_dir, args.timeout)
                found = []
                for line, shown in outputs if ok else []:
                    found += banner_problems(os.path.relpath(f, src), line, shown, out)
                print(f"  {'ok  ' if ok and not found else 'FAIL'} {rel} ({secs:.0f} s)"
                      + (f"; its output shown at line {', '.join(str(l) for l, _ in outputs)}: "
                         f"banner {'differs' if found else 'as printed'}" if ok and outputs else ""),
                      flush=True)
                if not ok:
                    problems.append(f"{rel}: the block failed:\n{text}\n--- output (end) ---\n"
                                    f"{out[-3000:]}")
                problems += found
        finally:
            for d in scratches.values():
                shutil.rmtree(d, ignore_errors=True)
    for p in problems:
        print("docs check: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
