#!/usr/bin/env python3
"""Writes crates/kvroute/tests/fixtures/tokenizer_golden.json: a fixed corpus and the token ids the
shipped tokenizer (assets/tokenizer/tokenizer.json) gives for it under Hugging Face's reference
implementation (the `tokenizers` wheel from PyPI, whose pre-tokenizer regexes run on Oniguruma).

kvroute builds `tokenizers` with the pure-Rust `fancy-regex` backend instead of Oniguruma (no C
build); the test `tokenizer_golden` proves that backend gives the same ids on this corpus.

Usage: python3 -m venv /tmp/tokvenv && /tmp/tokvenv/bin/pip install tokenizers
       /tmp/tokvenv/bin/python scripts/gen_tokenizer_golden.py
"""
import json
import pathlib
import random

import tokenizers

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "assets/tokenizer/tokenizer.json"
OUT = ROOT / "crates/kvroute/tests/fixtures/tokenizer_golden.json"

HANDPICKED = [
    "",
    " ",
    "   ",
    "\n",
    "\n\n\n",
    "\t\t x",
    "Hello, world!",
    "I'm sure you'll see it's what they've said we'd do.",
    "Don't  DON'T don 't",
    "The year 2024 had 366 days; 3.14159 and 1,000,000 and -42.",
    "multiple    spaces   between\twords\r\nand CRLF",
    "trailing spaces   ",
    "   leading spaces",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    "def f(x):\n    return x ** 2  # square\n",
    '{"model": "m", "prompt": [1, 2, 3], "max_tokens": 16}',
    "naïve café résumé coöperate",
    "e\u0301 vs \u00e9 (combining acute)",
    "Привет, мир! Как дела?",
    "你好，世界。今天天气很好。",
    "こんにちは、世界！カタカナとひらがな。",
    "안녕하세요 세계",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "שלום עולם",
    "Ελληνικά γράμματα",
    "emoji 😀😃😄 family 👨‍👩‍👧‍👦 flag 🇫🇷 skin 👍🏽",
    "non\u00a0breaking\u2003em\u3000ideographic space",
    "zero\u200bwidth\u200djoiner",
    "٣٤٥ ১২৩ ४५६ full-width １２３",
    "math ∑∫√∞ ≠ ≤ ≥ and arrows → ← ↔",
    "mixedCASEWords and snake_case and kebab-case and CamelCase123",
    "!!!??? ... --- *** ### @@@ $$$ %%%",
    "a" * 300,
    "ab " * 120,
]

ALPHABETS = [
    "abcdefghijklmnopqrstuvwxyz",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " \t\n\r\u00a0\u3000",
    ".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
    "абвгдеёжзийклмнопрстуфхцчшщъыьэюя",
    "的一是不了人我在有他这为之大来以个中上们",
    "ぁあぃいぅうぇえぉおかがきぎくぐ",
    "αβγδεζηθικλμνξοπρστυφχψω",
    "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
    "😀😁😂🤣😃😄😅😆😉😊🙂🙃",
    "\u0301\u0308\u0327\u200d\u200b\ufe0f",
]


def random_strings(count, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        pieces = []
        for _ in range(rng.randint(1, 12)):
            alphabet = rng.choice(ALPHABETS)
            pieces.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 10))))
            if rng.random() < 0.5:
                pieces.append(rng.choice([" ", "  ", "\n", "'s ", "'re ", " '", "\t"]))
        out.append("".join(pieces))
    return out


def main():
    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    cases = []
    for text in HANDPICKED + random_strings(400, seed=20261201):
        for add_special in (True, False):
            ids = tok.encode(text, add_special_tokens=add_special).ids
            cases.append({"text": text, "add_special_tokens": add_special, "ids": ids})
    doc = {
        "generator": "scripts/gen_tokenizer_golden.py",
        "reference": f"tokenizers {tokenizers.__version__} (Python wheel, Oniguruma regexes)",
        "tokenizer": "assets/tokenizer/tokenizer.json",
        "cases": cases,
    }
    OUT.write_text(json.dumps(doc, ensure_ascii=False, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {len(cases)} cases to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
