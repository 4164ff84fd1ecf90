#!/usr/bin/env python3
"""Regenerates tests/fixtures/tokenizer_cases.json: GPT-2 token ids from independent references.

Tooling only (never a runtime dependency of shardtrain). Two references are run on every case
and must agree before anything is written:

  1. A line-for-line reimplementation of OpenAI's gpt-2/src/encoder.py (the `regex` package,
     bytes_to_unicode, rank-ordered BPE merges), which defines GPT-2's ids.
  2. Hugging Face `tokenizers`: a ByteLevel BPE built offline from the same encoder.json and
     vocab.bpe, with "<|endoftext|>" added as a special token for the encode() cases.

Both are first checked against ids known from GPT-2 itself. Requirements:
    pip install regex tokenizers

Usage (from the repository root):
    python3 tools/make_tokenizer_fixture.py \
        [--tokenizer-dir data/gpt2-tokenizer] [--data-dir /work/shared/data] \
        [--out tests/fixtures/tokenizer_cases.json]

--data-dir must hold wikitext-2/wiki.train.tokens and tinyshakespeare/input.txt; a few lines of
each are copied into the fixture so the test itself needs neither.
"""

import argparse
import json
import os
import sys
from functools import lru_cache

import regex
import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

EOT = "<|endoftext|>"
KNOWN_TEXT = "Hello world, this is GPT-2 tokenization test."
KNOWN_IDS = [15496, 995, 11, 428, 318, 402, 11571, 12, 17, 11241, 1634, 1332, 13]


# ---- reference 1: OpenAI gpt-2/src/encoder.py -------------------------------------------------
def bytes_to_unicode():
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
          list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def get_pairs(word):
    pairs = set()
    prev_char = word[0]
    for char in word[1:]:
        pairs.add((prev_char, char))
        prev_char = char
    return pairs


class OpenAIEncoder:
    def __init__(self, encoder, bpe_merges):
        self.encoder = encoder
        self.byte_encoder = bytes_to_unicode()
        self.bpe_ranks = dict(zip(bpe_merges, range(len(bpe_merges))))
        self.pat = regex.compile(
            r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    @lru_cache(maxsize=None)
    def bpe(self, token):
        word = tuple(token)
        pairs = get_pairs(word)
        if not pairs:
            return token
        while True:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                    new_word.extend(word[i:j])
                    i = j
                except ValueError:
                    new_word.extend(word[i:])
                    break
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
            if len(word) == 1:
                break
            pairs = get_pairs(word)
        return " ".join(word)

    def encode_ordinary(self, text):
        bpe_tokens = []
        for token in regex.findall(self.pat, text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            bpe_tokens.extend(self.encoder[t] for t in self.bpe(token).split(" "))
        return bpe_tokens

    def encode(self, text):
        # "<|endoftext|>" splits the text; the pieces are encoded ordinarily (as Hugging Face's
        # GPT2Tokenizer does with its special token).
        ids = []
        for i, piece in enumerate(text.split(EOT)):
            if i > 0:
                ids.append(self.encoder[EOT])
            ids.extend(self.encode_ordinary(piece))
        return ids


def load_openai(tokenizer_dir):
    with open(os.path.join(tokenizer_dir, "encoder.json"), encoding="utf-8") as f:
        encoder = json.load(f)
    with open(os.path.join(tokenizer_dir, "vocab.bpe"), encoding="utf-8") as f:
        bpe_data = f.read()
    bpe_merges = [tuple(s.split()) for s in bpe_data.split("\n")[1:-1]]
    return OpenAIEncoder(encoder, bpe_merges)


# ---- reference 2: Hugging Face tokenizers -------------------------------------------------------
def load_hf(tokenizer_dir, with_special):
    tok = Tokenizer(
        models.BPE.from_file(os.path.join(tokenizer_dir, "encoder.json"),
                             os.path.join(tokenizer_dir, "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if with_special:
        tok.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
    return tok


# ---- the cases ----------------------------------------------------------------------------------
def read_head_lines(path, count, skip_blank):
    lines = []
    with open(path, encoding="utf-8", newline="") as f:
        for line in f:
            if skip_blank and not line.strip():
                continue
            lines.append(line)
            if len(lines) == count:
                break
    return lines


def make_cases(data_dir):
    cases = [
        ("known_sentence", KNOWN_TEXT),
        ("empty", ""),
        ("accents", "Café naïve résumé — Zürich, São Paulo, Ångström, Œuvre, ﬁn, Đặng"),
        ("combining_marks", "e\u0301te\u0301 vs été; n\u0303 and a\u030a"),
        ("cjk", "日本語のテキスト、中文文本和한국어 텍스트。東京は2024年に"),
        ("emoji", "I ❤️ 🦀 and 👩‍👩‍👧‍👦 family 🎉🎉 👍🏽!"),
        ("scripts", "مرحبا بالعالم — नमस्ते दुनिया — สวัสดีชาวโลก — Привет, мир — Γειά σου"),
        ("crlf", "line one\r\nline two\r\n\r\nline three\r\n"),
        ("multiple_spaces", "a  b   c    d     e"),
        ("tabs", "tab\tseparated\t\tvalues\t"),
        ("trailing_spaces", "trailing spaces   "),
        ("newlines_only", "\n\n\n"),
        ("leading_whitespace", "   leading and \n  indented\n\tcode"),
        ("mixed_whitespace", " \t \n mixed \r\n\t\n  end \n"),
        ("unicode_whitespace",
         "nbsp\u00a0here\u3000ideographic\u2003em\u2028ls\u0085nel\u180emvs\u200bzwsp  \u00a0x"),
        ("contractions", "I'm sure you'll see it's what we've done; they'd say they're DON'T, "
                         "isn't I'M 'S 'sup ''ll rock'n'roll"),
        ("numbers", "In 2024, 3.14159 and 1,000,000 people paid $12.50 (≈ 10%) ½ ² ٣ Ⅻ 0x1F"),
        ("punctuation_runs", "Wait...!!! ??? --- ==== @#$%^&*() <<>> ''' \"\"\" .,;: ~~~ :-)"),
        ("code", "def f(x):\n    return x**2  # square\n\nif __name__ == '__main__':\n"
                 "    print(f(3))\n"),
        ("control_chars", "a\x00b\x01c\x1f\x7fd\x0b\x0ce"),
        ("endoftext_alone", EOT),
        ("endoftext_between", "Hello<|endoftext|>world"),
        ("endoftext_spaced", "first document.\n<|endoftext|> second document<|endoftext|>"
                             "<|endoftext|>\n"),
        ("endoftext_partial", "<|endoftext| <|endoftext <endoftext|> |endoftext|>"),
        ("long_letters", "supercalifragilisticexpialidocious" * 60),
        ("long_repeat", "a" * 2000),
        ("long_punct", "=" * 1500 + "-+" * 300),
        ("long_digits", "1234567890" * 100),
        ("long_spaces", " " * 300 + "x" + "\n" * 500 + "y" + "\t " * 100),
    ]
    wiki = read_head_lines(os.path.join(data_dir, "wikitext-2", "wiki.train.tokens"), 8, True)
    for i, line in enumerate(wiki):
        cases.append((f"wikitext2_line{i}", line))
    cases.append(("wikitext2_block", "".join(
        read_head_lines(os.path.join(data_dir, "wikitext-2", "wiki.train.tokens"), 12, False))))
    with open(os.path.join(data_dir, "tinyshakespeare", "input.txt"), encoding="utf-8",
              newline="") as f:
        shakespeare = f.read(2000)
    cases.append(("tinyshakespeare_head", shakespeare))
    return cases


def to_json(doc):
    """Pretty JSON with one line per field of a case (id lists stay on one line); ASCII only,
    so the exact bytes of every text are visible as escapes."""
    def dumps(v):
        return json.dumps(v, ensure_ascii=True)

    lines = ["{"]
    lines.append(f' "description": {dumps(doc["description"])},')
    lines.append(f' "known": {dumps(doc["known"])},')
    lines.append(' "cases": [')
    for i, case in enumerate(doc["cases"]):
        fields = [f'   "{k}": {dumps(v)}' for k, v in case.items()]
        comma = "," if i + 1 < len(doc["cases"]) else ""
        lines.append("  {\n" + ",\n".join(fields) + "\n  }" + comma)
    lines.append(" ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer-dir", default=os.path.join(root, "data", "gpt2-tokenizer"))
    ap.add_argument("--data-dir", default="/work/shared/data")
    ap.add_argument("--out", default=os.path.join(root, "tests", "fixtures",
                                                  "tokenizer_cases.json"))
    args = ap.parse_args()

    openai = load_openai(args.tokenizer_dir)
    hf_special = load_hf(args.tokenizer_dir, with_special=True)
    hf_plain = load_hf(args.tokenizer_dir, with_special=False)

    for name, got in [("encoder.py", openai.encode(KNOWN_TEXT)),
                      ("tokenizers", hf_special.encode(KNOWN_TEXT).ids)]:
        if got != KNOWN_IDS:
            sys.exit(f"reference {name} gives {got} for {KNOWN_TEXT!r}, expected {KNOWN_IDS}")

    out_cases = []
    for name, text in make_cases(args.data_dir):
        enc = openai.encode(text)
        ordinary = openai.encode_ordinary(text)
        hf_enc = hf_special.encode(text).ids
        hf_ord = hf_plain.encode(text).ids
        if enc != hf_enc or ordinary != hf_ord:
            sys.exit(f"references disagree on case {name!r}:\n  encoder.py  {enc}\n"
                     f"  tokenizers  {hf_enc}\n  (ordinary: {ordinary} vs {hf_ord})")
        if hf_special.decode(enc, skip_special_tokens=False) != text:
            sys.exit(f"reference does not round-trip case {name!r}")
        out_cases.append({"name": name, "text": text, "encode": enc, "encode_ordinary": ordinary})

    doc = {
        "description": "GPT-2 BPE ids from OpenAI encoder.py (regex " + regex.__version__ +
                       ") and Hugging Face tokenizers " + tokenizers.__version__ +
                       " (which agree on every case); regenerate with "
                       "tools/make_tokenizer_fixture.py",
        "known": {"text": KNOWN_TEXT, "ids": KNOWN_IDS},
        "cases": out_cases,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(to_json(doc))
    print(f"wrote {len(out_cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
