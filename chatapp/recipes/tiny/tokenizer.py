"""Training the byte-level BPE tokenizers chatapp uses (the tiny model's, and the small ones tests build).

Byte-level BPE (GPT-2 style: every byte is reachable, so any text round-trips). The chat special tokens are added
as special tokens so they are single ids that ordinary text can never produce.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from chatapp.special_tokens import CHAT_TOKENS

CHAT_SPECIAL_TOKENS: tuple[str, ...] = tuple(CHAT_TOKENS.values())


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: tuple[str, ...] = CHAT_SPECIAL_TOKENS,
    min_frequency: int = 2,
    individual_digits: bool = False,
    isolated: str = "",
    spell_quoted_words: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `texts`. Special tokens take the first ids, in the order given.

    `individual_digits` splits every number into single digits before BPE (as Llama and nanochat-style arithmetic
    tokenizers do): a number's digits are then the same ids wherever it appears, so a small model copies operands
    and results digit by digit instead of memorising one id per multi-digit chunk.

    `isolated` characters are always tokens of their own, never merged with a neighbour. The tiny model isolates
    `"`: a quoted word in a question (` "word"`) then starts with the same `"` id as the word the model quotes in
    its calculator call (`"word".count(...)`), so copying the word is a plain match-and-copy (induction) step
    instead of a lookup across two different ids (`Ġ"` vs `"`).

    `spell_quoted_words` cuts a lowercase word in double quotes (`"banana"`) into one token per letter, quotes
    separate, as digits are: the tiny model's letter-counting questions quote the word and its calculator call
    quotes it again, so copying an unseen word is copying 26 well-trained letter ids instead of BPE pieces it met in
    other words (which it copies wrongly: `"lavender"` as `"lav5`). Words outside quotes merge as usual. Two regex splits do it
    (the second only finds letters whose piece ends in a quote, i.e. the quoted words the first cut out), so the
    rule is plain data in tokenizer.json; a text that itself ends in `word"` also gets that word spelled.
    """
    tok = Tokenizer(models.BPE())
    steps: list[pre_tokenizers.PreTokenizer] = []
    if spell_quoted_words:
        steps.append(pre_tokenizers.Split(Regex('"[a-z]+"'), "isolated"))
        steps.append(pre_tokenizers.Split(Regex('[a-z](?=[a-z]*"\\z)'), "isolated"))
    if isolated:
        steps.append(pre_tokenizers.Split(Regex("[" + "".join(re.escape(c) for c in isolated) + "]"), "isolated"))
    if individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
