"""Deterministic byte-level BPE tokenizer for the ``tiny`` model preset.

The tokenizer is trained with the `tokenizers` library on a small corpus generated here in code
(English words and sentences, arithmetic, chat snippets), so it needs no download and every
machine builds the same vocabulary.  Properties:

- byte-level BPE (any UTF-8 text round-trips through encode/decode);
- digits are always single tokens (``pre_tokenizers.Digits(individual_digits=True)``), which
  helps small models learn arithmetic;
- special tokens ``<|endoftext|>`` (id 0, also padding), ``<|im_start|>`` (id 1) and
  ``<|im_end|>`` (id 2, the eos token);
- a ChatML chat template, so ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``
  renders ``<|im_start|>role\\ncontent<|im_end|>\\n`` blocks.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A hand-written vocabulary of common English words (no external word list is used).
_WORDS = """
the be to of and a in that have it for not on with he as you do at this but his by from they we
say her she or an will my one all would there their what so up out if about who get which go me
when make can like time no just him know take people into year your good some could them see
other than then now look only come its over think also back after use two how our work first
well way even new want because any these give day most us is are was were been has had did done
said made went gone came seen took given found told asked used called tried left felt kept began
shown heard played ran moved lived believed brought happened wrote sat stood lost paid met
included continued set learned changed led understood watched followed stopped created spoke read
spent grew opened walked won offered remembered loved considered appeared bought waited served
died sent expected built stayed fell cut reached killed remained suggested raised passed sold
required reported decided pulled man woman child world life hand part place case week company
system program question government number night point home water room mother area money story
fact month lot right study book eye job word business issue side kind head house service friend
father power hour game line end member law car city community name president team minute idea
kid body information school face others level office door health person art war history party
result change morning reason research girl guy moment air teacher force education food music
tree river mountain sea sky sun moon star rain snow wind fire stone road bridge garden flower
bird fish dog cat horse cow apple bread milk cheese egg rice soup tea coffee table chair bed
window paper pen letter picture color red blue green yellow black white small large big little
long short high low old young early late hot cold warm cool happy sad easy hard fast slow
important different same great best better bad worse worst true false open close full empty
simple clear ready strong weak light dark heavy free sure real possible public private local
answer add sum plus minus times equals divide multiply subtract count total value result
math problem solve compute number digit zero one two three four five six seven eight nine ten
eleven twelve twenty thirty forty fifty hundred thousand million first second third last next
question please thank thanks hello hi yes okay sorry welcome help assistant user system helpful
explain describe write list summarize translate example because therefore however although
before after during while until since between under above below near far inside outside
here there where why how what which who whom whose always never often sometimes usually
today tomorrow yesterday morning evening night spring summer autumn winter monday friday
""".split()

_NAMES = [
    "Alice",
    "Bob",
    "Carol",
    "Dave",
    "Eve",
    "Frank",
    "Grace",
    "Heidi",
    "Ivan",
    "Judy",
    "Mallory",
    "Oscar",
    "Peggy",
    "Trent",
    "Victor",
    "Walter",
]

_TEMPLATES = [
    "{A} has {n} {w}s and buys {m} more.",
    "How many {w}s does {A} have now?",
    "The {w} is {adj} and the {w2} is {adj2}.",
    "{A} said that the {w} was {adj} today.",
    "What is {n} plus {m}?",
    "What is {n} times {m}?",
    "Please explain why the {w} is {adj}.",
    "I think the {w} and the {w2} are {adj}.",
    "{A} and {B} went to the {w} in the {t}.",
    "Can you help me write a {adj} story about a {w}?",
    "There are {n} {w}s near the {w2}.",
    "Thank you! The answer is {k}.",
]


def build_corpus(seed: int = 0, n_lines: int = 20000) -> list[str]:
    """Return the fixed training corpus for the tiny tokenizer: a list of ``n_lines`` strings.

    Deterministic for a given ``seed`` (uses ``random.Random(seed)`` only).
    """
    rng = random.Random(seed)
    lines: list[str] = []
    times = ["morning", "evening", "night", "summer", "winter"]
    for i in range(n_lines):
        kind = i % 5
        if kind == 0:  # arithmetic
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice(["+", "-", "*"])
            val = a + b if op == "+" else a - b if op == "-" else a * b
            lines.append(f"{a} {op} {b} = {val}")
        elif kind == 1:  # template sentence
            tpl = rng.choice(_TEMPLATES)
            n, m = rng.randint(1, 99), rng.randint(1, 99)
            lines.append(
                tpl.format(
                    A=rng.choice(_NAMES),
                    B=rng.choice(_NAMES),
                    n=n,
                    m=m,
                    k=n + m,
                    w=rng.choice(_WORDS),
                    w2=rng.choice(_WORDS),
                    adj=rng.choice(_WORDS),
                    adj2=rng.choice(_WORDS),
                    t=rng.choice(times),
                )
            )
        elif kind == 2:  # random word sequence, sentence cased
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
            words[0] = words[0].capitalize()
            lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", ";", ":"]))
        elif kind == 3:  # chat snippet
            question = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8)))
            answer = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8)))
            lines.append(f"<|im_start|>user\n{question}?<|im_end|>\n<|im_start|>assistant\n{answer}.<|im_end|>\n")
        else:  # code-ish / punctuation / numbers in text
            x, y, z = rng.choice(_WORDS), rng.randint(0, 9999), rng.choice(_WORDS)
            lines.append(f'{x} = ({y}, "{z}") # {rng.choice(_WORDS)} [{x}] {{ok}}')
    return lines


def build_tiny_tokenizer(vocab_size: int = 2048, seed: int = 0):
    """The tiny preset's tokenizer as a ``PreTrainedTokenizerFast`` (a new object each call).

    ``vocab_size`` is an upper bound on the vocabulary (specials + 256 byte symbols + merges);
    ``len(tokenizer)`` may be smaller if the corpus runs out of merges.  Deterministic: the BPE
    is trained once per process and arguments (:func:`trained_bpe`).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(trained_bpe(vocab_size, seed)),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


@functools.lru_cache(maxsize=4)
def trained_bpe(vocab_size: int = 2048, seed: int = 0) -> str:
    """The byte-level BPE of the tiny preset trained on ``build_corpus(seed)``, as the JSON of a
    ``tokenizers.Tokenizer``; trained once per process and arguments (about a second),
    ``trained_bpe.__wrapped__`` trains anew."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(seed), trainer=trainer)
    return str(tok.to_str())


def save_tiny_tokenizer(path: Path, vocab_size: int = 2048, seed: int = 0):
    """Build the tiny tokenizer and ``save_pretrained`` it into ``path``; returns the tokenizer."""
    tok = build_tiny_tokenizer(vocab_size=vocab_size, seed=seed)
    tok.save_pretrained(str(path))
    return tok
