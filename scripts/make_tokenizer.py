#!/usr/bin/env python3
"""Regenerates assets/tokenizer/ (tokenizer.json + tokenizer_config.json).

kvroute's simulated engine and the router must tokenize identically, and tests must not depend
on downloading a model, so the repository ships its own small byte-level BPE tokenizer. This
script trains it from scratch on synthetic text produced right here (a hand-written word list
plus pseudo-words built from syllables, arranged into sentences by a seeded RNG), so the result
is deterministic and owes nothing to any third-party corpus.

Usage (needs the `tokenizers` Python package, e.g. in a throwaway venv):
    python3 -m venv /tmp/tokvenv && /tmp/tokvenv/bin/pip install tokenizers
    /tmp/tokvenv/bin/python scripts/make_tokenizer.py
CI does not run this; the generated files are committed.
"""

import json
import pathlib
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 8192
SEED = 20261130
SENTENCES = 60_000
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

# ChatML-style template: one block per message, then the assistant header when asked to.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WORDS = """
the a an this that these those some every each any many few most all none one two three four
five six seven eight nine ten hundred thousand router engine request cache block prefix token
model server client worker replica rank queue latency throughput memory device host disk page
tree node leaf root parent child hash event batch stream socket message frame topic sequence
replay gap snapshot cursor index shard lock thread task process signal timer clock second
minute hour day week month year morning evening night river mountain forest garden city road
bridge harbor island valley desert ocean lake field meadow village market library school
station kitchen window door table chair book letter story poem song music picture color light
shadow water fire stone wind rain snow cloud sun moon star planet system network protocol
packet buffer limit error warning result answer question reason idea plan goal method detail
example number value list map set key field record file folder path line word sentence text
language voice name place time way thing people person friend teacher student doctor farmer
builder writer reader player runner driver pilot sailor baker painter singer dancer keeper
is are was were be been being has have had do does did will would can could should may might
must shall runs keeps sends reads writes stores removes clears moves holds takes gives makes
finds builds breaks fixes opens closes starts stops waits counts checks routes serves learns
quick slow large small long short high low warm cold bright dark early late new old young
simple hard soft clear busy quiet happy calm strong gentle green blue red yellow white black
and or but so because while when where if then than after before during until since through
over under above below between among with without within into onto from to of in on at by for
about across along around near far here there today tomorrow yesterday always never often
again also only just still even very really quite almost nearly perhaps maybe together
""".split()

SYLLABLES = """
ka ri to na me lo su vi de pa mo ne shi ta ro ku ze fa li no ga be ti ra mu so ve ki da po
lu ha ye ni ma te zo bi fu ce ru do ja wi xo qu tra ple stro gri blu cha fro kle sna vor tem
lin dar mes kor pil nus ven gal tor ber sim lak dun fen har jol mik nor pes rin sol tav wun
""".split()

PUNCT = [".", ".", ".", "!", "?", ","]


def pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))


def sentence(rng: random.Random, lexicon: list[str]) -> str:
    n = rng.randint(4, 18)
    words = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.70:
            words.append(rng.choice(WORDS))
        elif roll < 0.93:
            # A Zipf-like pick from the pseudo-word lexicon so common ones merge into tokens.
            words.append(lexicon[min(int(rng.paretovariate(1.1)) - 1, len(lexicon) - 1)])
        else:
            words.append(str(rng.randint(0, 99_999)))
    text = " ".join(words)
    text = text[0].upper() + text[1:]
    return text + rng.choice(PUNCT)


def corpus(rng: random.Random):
    lexicon = [pseudo_word(rng) for _ in range(20_000)]
    for _ in range(SENTENCES):
        yield " ".join(sentence(rng, lexicon) for _ in range(rng.randint(1, 4)))


def main() -> None:
    out_dir = pathlib.Path(__file__).resolve().parent.parent / "assets" / "tokenizer"
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(rng), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": BOS_TOKEN,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"vocab {tok.get_vocab_size()} -> {out_dir}")


if __name__ == "__main__":
    main()
