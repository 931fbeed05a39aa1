"""The synthetic conversation corpus the shipped tiny model is trained and evaluated on.

The tiny model is small, so what it can do is exactly what this corpus teaches: calling the calculator for
arithmetic and letter counting (nanochat's python / python_output parts), greetings and small talk, answering from a
small fact table owned here, answering in one exact JSON shape when asked for JSON, and thinking inside
``<think>`` … ``</think>`` before answering when asked to think (the shipped TTFA programs drive these formats).

Generalisation is measured on a held-out split that shares no question with training: operands, words, facts' phrasing
templates and the requests for JSON / thinking are partitioned between the splits (`_pools`, by the rules of
`recipes.chats`). Everything is drawn from a `random.Random` seeded per split, so the same ``(split, n, seed)``
always gives the same conversations.

Calculator calls and their output text are `recipes.chats`' (the engine's own calculator), shared with the SmolLM2
recipe; the wording around them is this corpus's.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from chatapp.recipes.chats import (
    LETTER_COUNT_ANSWERS,
    SPLITS,
    Calculation,
    Split,
    arithmetic,
    held_out_number,
    letter_count,
    split_list,
    tool_exchange,
)

Kind = Literal["arithmetic", "letters", "fact", "smalltalk"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class Conversation:
    """One training / evaluation conversation and what a correct final answer must contain.

    `messages` is in the chat message format of `chatapp.chat` (assistant content may be a list of parts).
    `expected` is the answer itself (the number for arithmetic and letter counting, the fact's value, the JSON
    object's text), `expression` the calculator expression a correct answer calls (None when no tool is needed).
    """

    kind: Kind
    messages: list[dict[str, Any]]
    expected: str
    expression: str | None = None
    json_answer: bool = False
    think: bool = False
    # Other replies that are just as right (small talk picks one of several replies at random).
    alternatives: tuple[str, ...] = ()

    @property
    def question(self) -> str:
        """The last user message: the question this conversation is about."""
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "user")

    @property
    def prompt(self) -> list[dict[str, Any]]:
        """The messages before the final assistant answer: what a model is given at evaluation time."""
        return self.messages[:-1]


# Arithmetic: {a} and {b} are operands, phrases per operator. The python expression is always canonical (`a*b`).
_OPERATOR_PHRASES: dict[str, list[str]] = {
    "+": [
        "What is {a}+{b}?",
        "What is {a} + {b}?",
        "what is {a} plus {b}?",
        "Calculate {a} + {b}.",
        "How much is {a} plus {b}?",
        "Add {a} and {b}.",
        "What do you get if you add {a} to {b}?",
        "{a}+{b}=?",
        "Compute the sum of {a} and {b}.",
        "Please work out {a} + {b}",
        "what's {a} plus {b}",
        "Can you add {a} and {b} for me?",
        "What is the sum of {a} and {b}?",
        "{a} plus {b} is what?",
        "Tell me {a} + {b}.",
        "I need {a} + {b}.",
    ],
    "-": [
        "What is {a}-{b}?",
        "What is {a} - {b}?",
        "what is {a} minus {b}?",
        "Calculate {a} - {b}.",
        "How much is {a} minus {b}?",
        "Subtract {b} from {a}.",
        "What is {a} take away {b}?",
        "{a}-{b}=?",
        "Compute {a} minus {b}.",
        "Please work out {a} - {b}",
        "what's {a} minus {b}",
        "Can you subtract {b} from {a} for me?",
        "What is the difference between {a} and {b}?",
        "{a} minus {b} is what?",
        "Tell me {a} - {b}.",
        "I need {a} - {b}.",
    ],
    "*": [
        "What is {a}*{b}?",
        "What is {a} * {b}?",
        "what is {a} times {b}?",
        "Calculate {a} * {b}.",
        "How much is {a} times {b}?",
        "Multiply {a} by {b}.",
        "What is {a} multiplied by {b}?",
        "{a}*{b}=?",
        "Compute the product of {a} and {b}.",
        "Please work out {a} * {b}",
        "what's {a} times {b}",
        "Can you multiply {a} and {b} for me?",
        "What is the product of {a} and {b}?",
        "{a} times {b} is what?",
        "Tell me {a} * {b}.",
        "I need {a} * {b}.",
    ],
    "/": [
        "What is {a}/{b}?",
        "What is {a} / {b}?",
        "what is {a} divided by {b}?",
        "Calculate {a} / {b}.",
        "How much is {a} divided by {b}?",
        "Divide {a} by {b}.",
        "What do you get if you divide {a} by {b}?",
        "{a}/{b}=?",
        "Compute {a} divided by {b}.",
        "Please work out {a} / {b}",
        "what's {a} over {b}",
        "Can you divide {a} by {b} for me?",
        "What is the quotient of {a} and {b}?",
        "{a} divided by {b} is what?",
        "Tell me {a} / {b}.",
        "I need {a} / {b}.",
    ],
}
# Training-only phrasings that teach the words the held-out phrasings are made of. A model trained from scratch on
# this corpus knows a word only from the corpus, and the BPE tokens of `Add` (sentence-initial) and ` add` are
# unrelated ids: with no training phrasing starting `Add`, `Multiply` or `Divide`, a held-out `Add {a} and {b}.`
# is not understood at all, while held-out phrasings made of trained words are. These keep the held-out phrasings
# unseen as phrasings; `test_corpus` checks that every word of a held-out phrasing occurs in training ones.
_TRAIN_ONLY_OPERATOR_PHRASES: dict[str, list[str]] = {
    "+": [
        "Add {a} to {b}.",
        "Please add {a} and {b}.",
        "Could you work out {a} plus {b}?",
        "Tell me what {a} plus {b} is.",
    ],
    "-": [
        "Subtract {b} from {a} and give me the result.",
        "Please subtract {b} from {a}.",
        "Could you work out {a} minus {b}?",
        "Tell me what {a} minus {b} is.",
    ],
    "*": [
        "Multiply {a} and {b} together.",
        "Please multiply {a} by {b}.",
        "Could you work out {a} times {b}?",
        "Tell me what {a} times {b} is.",
    ],
    "/": [
        "Divide {a} into {b} equal parts.",
        "Please divide {a} by {b}.",
        "Could you work out {a} divided by {b}?",
        "Tell me what {a} divided by {b} is.",
    ],
}
# The empty preface calls the tool straight away: what the `calc` TTFA program forces (<|python_start|> first).
_CALC_PREFACES = ["Let me compute that. ", "I'll use the calculator. ", "Let me calculate. ", ""]
_CALC_ANSWERS = ["{expr} is {result}.", "The answer is {result}.", "{expr} = {result}."]
_OPERATOR_REASONING = {
    "/": "I need to divide {a} by {b}.",
    "+": "I need to add {a} and {b}.",
    "-": "I need to subtract {b} from {a}.",
    "*": "I need to multiply {a} by {b}.",
}

# Letter counting: the word is quoted in the question so it tokenizes exactly as inside the python string.
_LETTER_TEMPLATES = [
    'How many "{c}" are in "{w}"?',
    'How many times does the letter {c} appear in "{w}"?',
    'Count the letter {c} in "{w}".',
    'How many {c}\'s are there in "{w}"?',
    'how many {c} in "{w}"',
    'In the word "{w}", how many times does {c} occur?',
    'Count how many times "{c}" appears in the word "{w}".',
    'What is the number of {c} letters in "{w}"?',
    'How often does {c} occur in "{w}"?',
    'Count the {c}\'s in "{w}" for me.',
    'How many {c} letters does "{w}" have?',
    'Tell me how many times {c} appears in "{w}".',
    'In "{w}", how many {c}\'s are there?',
    'Please count the letter {c} in the word "{w}".',
    'How many occurrences of {c} are in "{w}"?',
    'Does "{w}" contain the letter {c}? How many times?',
    'count {c} in "{w}"',
    'The word "{w}": how many {c}\'s does it have?',
    'How many times is {c} in "{w}"?',
    'Can you count the letter {c} in "{w}"?',
    'Find how many {c} letters appear in "{w}".',
    'How many times can you find {c} in "{w}"?',
    'In the word "{w}", count the letter {c}.',
    'What is the count of {c} in "{w}"?',
]
# Training-only letter phrasings, for the same reason as `_TRAIN_ONLY_OPERATOR_PHRASES` (held-out `How many times can
# you find {c} in ...` was answered with `.count("f")`: ` find` was a word the model had never read).
_TRAIN_ONLY_LETTER_TEMPLATES = [
    'Could you count the {c}\'s in "{w}" for me?',
    'Please count how many {c}\'s are in "{w}".',
    'The word is "{w}". How many {c}\'s are in it?',
    'Tell me if you can find {c} in "{w}", and how many times.',
]
_LETTER_PREFACES = ["Let me count. ", "I'll count with the calculator. ", "Let me check. ", ""]
_LETTER_ANSWERS = [*LETTER_COUNT_ANSWERS, "The answer is {n}."]
_WORD_LIST = (
    "strawberry banana apple cherry orange lemon mango papaya grape melon peach pineapple coconut raspberry "
    "blueberry tomato potato carrot pepper onion garlic spinach cabbage broccoli cucumber pumpkin avocado "
    "elephant giraffe kangaroo penguin dolphin octopus squirrel rabbit turtle hamster parrot chicken monkey "
    "tiger zebra camel gorilla butterfly mosquito spider lobster jellyfish flamingo hedgehog raccoon "
    "mississippi bookkeeper committee balloon coffee letter success address possess assessment tennessee "
    "programming computer keyboard language algorithm function variable database network internet "
    "mountain river valley forest desert ocean island volcano glacier meadow canyon waterfall "
    "teacher student library pencil notebook eraser backpack classroom homework calendar "
    "happiness friendship adventure celebration knowledge question answer chocolate vanilla caramel "
    "umbrella bicycle airplane helicopter submarine rocket tractor scooter skateboard engineer "
    "basketball football baseball volleyball marathon swimming gymnastics referee "
    "kitchen bedroom bathroom hallway window curtain carpet pillow blanket mirror "
    "summer winter autumn spring morning evening midnight yesterday tomorrow weekend "
    "purple yellow silver golden scarlet emerald crimson turquoise lavender"
)
_WORDS = _WORD_LIST.split()
_HELDOUT_WORDS = frozenset(split_list(_WORDS, "heldout", every=5))

# Facts the generator owns: (category, key, value).
_CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Brazil": "Brasilia",
    "Argentina": "Buenos Aires",
    "Peru": "Lima",
    "Russia": "Moscow",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Turkey": "Ankara",
    "Australia": "Canberra",
    "Ireland": "Dublin",
    "Austria": "Vienna",
    "Belgium": "Brussels",
    "Netherlands": "Amsterdam",
    "Denmark": "Copenhagen",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Chile": "Santiago",
    "Cuba": "Havana",
}
_COLOURS = {
    "the sky": "blue",
    "grass": "green",
    "a banana": "yellow",
    "snow": "white",
    "coal": "black",
    "a tomato": "red",
    "an orange": "orange",
    "a lemon": "yellow",
    "the sun": "yellow",
    "milk": "white",
    "a strawberry": "red",
    "a carrot": "orange",
    "an emerald": "green",
    "chocolate": "brown",
    "a flamingo": "pink",
    "the ocean": "blue",
    "a crow": "black",
    "an eggplant": "purple",
    "a polar bear": "white",
    "a pumpkin": "orange",
}
_SOUNDS = {
    "dog": "woof",
    "cat": "meow",
    "cow": "moo",
    "duck": "quack",
    "sheep": "baa",
    "pig": "oink",
    "lion": "roar",
    "owl": "hoot",
    "horse": "neigh",
    "frog": "ribbit",
    "snake": "hiss",
    "bee": "buzz",
    "mouse": "squeak",
}
_LEGS = {
    "dog": "4",
    "cat": "4",
    "spider": "8",
    "bird": "2",
    "ant": "6",
    "horse": "4",
    "chicken": "2",
    "beetle": "6",
    "octopus": "8",
    "snake": "0",
    "fish": "0",
    "cow": "4",
    "duck": "2",
    "bee": "6",
    "crab": "10",
}
_OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "fast": "slow",
    "happy": "sad",
    "light": "dark",
    "open": "closed",
    "early": "late",
    "loud": "quiet",
    "full": "empty",
    "old": "new",
    "hard": "soft",
    "wet": "dry",
    "rich": "poor",
    "strong": "weak",
    "high": "low",
    "near": "far",
    "left": "right",
    "true": "false",
    "first": "last",
}


@dataclass(frozen=True)
class _FactCategory:
    """One kind of fact: question templates, the plain answer, the JSON topic and a line of reasoning."""

    table: dict[str, str]
    questions: list[str]
    answer: str
    topic: str
    reasoning: str


_FACTS: dict[str, _FactCategory] = {
    "capital": _FactCategory(
        _CAPITALS,
        [
            "What is the capital of {k}?",
            "Which city is the capital of {k}?",
            "Name the capital of {k}.",
            "Tell me the capital of {k}.",
            "what's the capital of {k}",
            "Do you know the capital of {k}?",
            "What city is the capital of {k}?",
            "capital of {k}?",
        ],
        "The capital of {k} is {v}.",
        "capital of {k}",
        "The question is about the capital of {k}. The capital of {k} is {v}.",
    ),
    "colour": _FactCategory(
        _COLOURS,
        [
            "What colour is {k}?",
            "What color is {k}?",
            "Which colour is {k}?",
            "Tell me the colour of {k}.",
            "what color is {k} usually",
            "What is the colour of {k}?",
            "Do you know what colour {k} is?",
            "colour of {k}?",
        ],
        "{K} is {v}.",
        "colour of {k}",
        "The question is about the colour of {k}. {K} is {v}.",
    ),
    "sound": _FactCategory(
        _SOUNDS,
        [
            "What sound does a {k} make?",
            "What does a {k} say?",
            "Which sound does a {k} make?",
            "Tell me the sound a {k} makes.",
            "what noise does a {k} make",
            "How does a {k} sound?",
            "Do you know what a {k} says?",
            "sound of a {k}?",
        ],
        "A {k} says {v}.",
        "sound of a {k}",
        "The question is about the sound of a {k}. A {k} says {v}.",
    ),
    "legs": _FactCategory(
        _LEGS,
        [
            "How many legs does a {k} have?",
            "How many legs has a {k} got?",
            "Tell me how many legs a {k} has.",
            "Count the legs of a {k}.",
            "how many legs on a {k}",
            "What is the number of legs of a {k}?",
            "Do you know how many legs a {k} has?",
            "legs of a {k}?",
        ],
        "A {k} has {v} legs.",
        "legs of a {k}",
        "The question is about the legs of a {k}. A {k} has {v} legs.",
    ),
    "opposite": _FactCategory(
        _OPPOSITES,
        [
            "What is the opposite of {k}?",
            "What's the opposite of {k}?",
            "Give me the opposite of {k}.",
            "Tell me the opposite of {k}.",
            "opposite of {k}?",
            "Which word is the opposite of {k}?",
            "Do you know the opposite of {k}?",
            "What word means the opposite of {k}?",
        ],
        "The opposite of {k} is {v}.",
        "opposite of {k}",
        "The question is about the opposite of {k}. The opposite of {k} is {v}.",
    ),
}

# Small talk: (user phrasings, assistant replies, JSON topic). Replies are shared by both splits.
_SMALLTALK: list[tuple[list[str], list[str], str]] = [
    (
        [
            "Hello!",
            "Hi",
            "Hey there!",
            "hello",
            "Good morning!",
            "Hi there",
            "Hey",
            "Good evening!",
            "Howdy!",
            "hi!",
            "Greetings!",
            "Hello there.",
        ],
        ["Hello! How can I help you today?", "Hi! What can I do for you?", "Hello! Ask me anything."],
        "greeting",
    ),
    (
        [
            "How are you?",
            "How are you doing?",
            "how's it going?",
            "How are you today?",
            "How do you feel?",
            "Are you doing well?",
            "how are things?",
            "What's up?",
        ],
        ["I am fine, thank you! How can I help?", "I'm doing well, thanks for asking."],
        "feelings",
    ),
    (
        [
            "Who are you?",
            "What is your name?",
            "What are you?",
            "Tell me about yourself.",
            "whats your name",
            "Introduce yourself.",
            "Who am I talking to?",
            "What should I call you?",
        ],
        [
            "I am a small assistant model. I can do arithmetic with a calculator, count letters and answer simple "
            "questions.",
            "I am a tiny chat model that runs on your computer.",
        ],
        "identity",
    ),
    (
        [
            "Thank you!",
            "Thanks",
            "thanks a lot",
            "Thank you very much.",
            "Cheers!",
            "Many thanks!",
            "thx",
            "Thanks for the help.",
        ],
        ["You're welcome!", "Happy to help!", "Any time!"],
        "thanks",
    ),
    (
        [
            "Goodbye!",
            "Bye",
            "See you later!",
            "bye bye",
            "Good night!",
            "Talk to you later.",
            "I have to go now.",
            "See you!",
        ],
        ["Goodbye! Have a nice day.", "Bye! See you soon."],
        "farewell",
    ),
    (
        [
            "What can you do?",
            "How can you help me?",
            "What are you good at?",
            "What can I ask you?",
            "help",
            "What do you know?",
            "What are your skills?",
            "Can you help me?",
        ],
        [
            "I can do arithmetic with a calculator, count letters in words, and answer simple questions about "
            "capitals, colours and animals.",
            "Ask me to calculate something, count letters, or tell you a fact.",
        ],
        "abilities",
    ),
]
_SMALLTALK_REASONING = "The user is making small talk. I should reply politely."

# Requests appended to a question.
_JSON_REQUESTS = [
    "Answer in JSON.",
    "Reply in JSON.",
    "Respond with JSON.",
    "Give the answer as JSON.",
    "Format your answer as JSON.",
    "Use JSON.",
    "Please answer in JSON format.",
    "Output JSON.",
    "Reply with a JSON object.",
    "JSON please.",
    "Write the answer in JSON.",
    "Answer using JSON.",
    "I need the answer as JSON.",
    "Respond in JSON format.",
    "Return JSON.",
    "Give me JSON.",
]
# Training-only, as `_TRAIN_ONLY_OPERATOR_PHRASES`: the words of the held-out requests.
_TRAIN_ONLY_THINK_REQUESTS = ["Think about it carefully first.", "Think it over before answering."]
_THINK_REQUESTS = [
    "Think first.",
    "Think before you answer.",
    "Think step by step.",
    "Reason it out first.",
    "Let's think about it.",
    "Think carefully.",
    "Take a moment to think.",
    "Please think it through.",
    "Think it over first.",
    "Think about it before answering.",
    "Think hard.",
    "First think, then answer.",
    "Think it through step by step.",
    "Please think first.",
    "Think before replying.",
    "Think a little first.",
]
_SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly assistant. Keep answers short.",
    "Answer questions briefly.",
]


def json_answer(topic: str, answer: str) -> str:
    """The exact JSON answer shape: compact, one space after ':' and ','; `json.dumps` escapes the strings."""
    return json.dumps({"topic": topic, "answer": answer}, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------------------------
# The generator.


@dataclass(frozen=True)
class CorpusMix:
    """Relative weights of conversation kinds and how often a request / extra turn is added."""

    arithmetic: float = 0.36
    letters: float = 0.30
    fact: float = 0.22
    smalltalk: float = 0.12
    think_rate: float = 0.2
    json_rate: float = 0.3  # of fact and small-talk conversations
    system_rate: float = 0.08
    greeting_turn_rate: float = 0.12  # a greeting exchange before the question


@dataclass
class _Pools:
    """What one split may draw from: the operands, words, templates and requests partitioned per split."""

    split: Split
    numbers_small: list[int]
    numbers_large: list[int]
    words: list[str]
    operator_phrases: dict[str, list[str]]
    letter_templates: list[str]
    fact_questions: dict[str, list[str]]
    smalltalk: list[tuple[list[str], list[str], str]]
    json_requests: list[str]
    think_requests: list[str]
    letters: str = field(default="abcdefghijklmnopqrstuvwxyz")

    @property
    def invents_words(self) -> bool:
        """Training also counts letters in invented words, so the model learns to copy any word it is given
        instead of memorising the word list (held-out words are real words it has never seen)."""
        return self.split == "train"


def _pools(split: Split) -> _Pools:
    heldout = split == "heldout"
    return _Pools(
        split=split,
        numbers_small=[n for n in range(2, 100) if held_out_number(n) == heldout],
        numbers_large=[n for n in range(100, 1000) if held_out_number(n) == heldout],
        words=split_list(_WORDS, split, every=5),
        operator_phrases={
            op: split_list(t, split, train_only=_TRAIN_ONLY_OPERATOR_PHRASES[op]) for op, t in _OPERATOR_PHRASES.items()
        },
        letter_templates=split_list(_LETTER_TEMPLATES, split, train_only=_TRAIN_ONLY_LETTER_TEMPLATES),
        fact_questions={name: split_list(c.questions, split) for name, c in _FACTS.items()},
        smalltalk=[(split_list(users, split), replies, topic) for users, replies, topic in _SMALLTALK],
        json_requests=split_list(_JSON_REQUESTS, split),
        think_requests=split_list(_THINK_REQUESTS, split, train_only=_TRAIN_ONLY_THINK_REQUESTS),
    )


def _with_request(question: str, request: str | None, rng: random.Random) -> str:
    if request is None:
        return question
    return f"{question} {request}" if rng.random() < 0.8 else f"{request} {question}"


def _think_text(reasoning: str) -> str:
    return f"{THINK_OPEN}{reasoning}{THINK_CLOSE}"


class _Generator:
    def __init__(self, split: Split, seed: int, mix: CorpusMix, word_pieces: Sequence[str] = ()) -> None:
        self.rng = random.Random(f"chatapp-corpus:{split}:{seed}")
        self.pools = _pools(split)
        self.mix = mix
        self.word_pieces = sorted(set(word_pieces))  # sorted: the corpus must not depend on the caller's order

    def conversation(self) -> Conversation:
        rng, mix = self.rng, self.mix
        kinds: list[Kind] = ["arithmetic", "letters", "fact", "smalltalk"]
        kind = rng.choices(kinds, weights=[mix.arithmetic, mix.letters, mix.fact, mix.smalltalk])[0]
        think = rng.random() < mix.think_rate
        json_answer_ = kind in ("fact", "smalltalk") and not think and rng.random() < mix.json_rate
        make: dict[Kind, Callable[[bool, bool], Conversation]] = {
            "arithmetic": self._arithmetic,
            "letters": self._letters,
            "fact": self._fact,
            "smalltalk": self._smalltalk,
        }
        conv = make[kind](think, json_answer_)
        prefix: list[dict[str, Any]] = []
        if rng.random() < mix.system_rate:
            prefix.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
        if kind != "smalltalk" and rng.random() < mix.greeting_turn_rate:
            users, replies, _ = self.pools.smalltalk[0]
            prefix += [
                {"role": "user", "content": rng.choice(users)},
                {"role": "assistant", "content": rng.choice(replies)},
            ]
        if not prefix:
            return conv
        return replace(conv, messages=prefix + conv.messages)

    def _request(self, think: bool, json_answer_: bool) -> str | None:
        if think:
            return self.rng.choice(self.pools.think_requests)
        if json_answer_:
            return self.rng.choice(self.pools.json_requests)
        return None

    def _operands(self, op: str) -> tuple[int, int]:
        p, rng = self.pools, self.rng
        if op == "/":  # exact division keeps results integers: draw the divisor and quotient, keep a split dividend
            while True:
                b = rng.choice(p.numbers_small)
                a = b * rng.randint(2, 99)
                if a < 1000 and held_out_number(a) == (p.split == "heldout"):
                    return a, b
        if op == "*":
            a = rng.choice(p.numbers_small)
            b = rng.choice(p.numbers_small if rng.random() < 0.7 else p.numbers_large)
        else:
            a = rng.choice(p.numbers_small if rng.random() < 0.3 else p.numbers_large)
            b = rng.choice(p.numbers_small if rng.random() < 0.5 else p.numbers_large)
        return (a, b) if rng.random() < 0.5 else (b, a)

    def _tool_conversation(
        self,
        kind: Kind,
        question: str,
        call: Calculation,
        answer: str,
        preface: str,
        reasoning: str,
        think: bool,
        json_answer_: bool,
    ) -> Conversation:
        """The question (with its request) and a calculator answer, the reasoning thought first when `think`."""
        opening = (_think_text(reasoning) if think else "") + preface
        user = _with_request(question, self._request(think, json_answer_), self.rng)
        return Conversation(kind, tool_exchange(user, call, answer, opening), call.result, call.expression, think=think)

    def _arithmetic(self, think: bool, json_answer_: bool) -> Conversation:
        rng = self.rng
        op = rng.choice(list(_OPERATOR_PHRASES))
        a, b = self._operands(op)
        question = rng.choice(self.pools.operator_phrases[op]).format(a=a, b=b)
        call = arithmetic(a, op, b)
        reasoning = _OPERATOR_REASONING[op].format(a=a, b=b) + " The calculator gives the exact value."
        answer = rng.choice(_CALC_ANSWERS).format(expr=call.expression, result=call.result)
        preface = rng.choice(_CALC_PREFACES)
        return self._tool_conversation("arithmetic", question, call, answer, preface, reasoning, think, json_answer_)

    def _invented_word(self) -> str:
        """A random lowercase word that is not a held-out word: random letters, or (when the caller gave the
        tokenizer's letter pieces) one to three pieces drawn uniformly.

        Why pieces: an unseen real word tokenizes into BPE pieces, and a piece that only ever occurred inside longer
        training words (`ine` in "pineapple", `tract` in "tractor") would otherwise reach the model with an embedding
        it never learned to copy. Uniform draws put every piece into a copying context a few dozen times.
        """
        while True:
            if self.word_pieces and self.rng.random() < 0.5:
                word = "".join(self.rng.choices(self.word_pieces, k=self.rng.randint(1, 3)))
                if not 3 <= len(word) <= 14:
                    continue
            else:
                word = "".join(self.rng.choices(self.pools.letters, k=self.rng.randint(3, 10)))
            if word not in _HELDOUT_WORDS:
                return word

    def _letters(self, think: bool, json_answer_: bool) -> Conversation:
        rng = self.rng
        word = (
            self._invented_word() if self.pools.invents_words and rng.random() < 0.6 else rng.choice(self.pools.words)
        )
        # Mostly a letter of the word (doubled letters are the interesting case), sometimes one it lacks.
        letter = rng.choice(word) if rng.random() < 0.85 else rng.choice(self.pools.letters)
        question = rng.choice(self.pools.letter_templates).format(c=letter, w=word)
        call = letter_count(word, letter)
        reasoning = f'I need to count the letter {letter} in "{word}". The calculator can count it.'
        answer = rng.choice(_LETTER_ANSWERS).format(n=call.result, c=letter, w=word)
        preface = rng.choice(_LETTER_PREFACES)
        return self._tool_conversation("letters", question, call, answer, preface, reasoning, think, json_answer_)

    def _fact(self, think: bool, json_answer_: bool) -> Conversation:
        rng = self.rng
        name = rng.choice(list(_FACTS))
        category = _FACTS[name]
        key = rng.choice(list(category.table))
        value = category.table[key]
        fields_ = {"k": key, "K": key[0].upper() + key[1:], "v": value}
        question = rng.choice(self.pools.fact_questions[name]).format(**fields_)
        user = _with_request(question, self._request(think, json_answer_), rng)
        sentence, topic = category.answer.format(**fields_), category.topic.format(**fields_)
        reasoning = category.reasoning.format(**fields_)
        return _text_conversation("fact", user, sentence, value, topic, reasoning, think, json_answer_)

    def _smalltalk(self, think: bool, json_answer_: bool) -> Conversation:
        rng = self.rng
        users, replies, topic = rng.choice(self.pools.smalltalk)
        reply = rng.choice(replies)
        user = _with_request(rng.choice(users), self._request(think, json_answer_), rng)
        return _text_conversation(
            "smalltalk", user, reply, reply, topic, _SMALLTALK_REASONING, think, json_answer_, alternatives=replies
        )


def _text_conversation(
    kind: Kind,
    user: str,
    sentence: str,
    value: str,
    topic: str,
    reasoning: str,
    think: bool,
    json_answer_: bool,
    alternatives: Sequence[str] = (),
) -> Conversation:
    """`user` answered without a tool: `sentence`, or when asked for JSON `{"topic": topic, "answer": value}`;
    after `reasoning` thought first when `think`. `value` is what a right plain answer contains."""
    if json_answer_:
        answer = expected = json_answer(topic, value)
    else:
        answer, expected = sentence, value
    if think:
        answer = _think_text(reasoning) + answer
    return Conversation(
        kind,
        [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
        expected=expected,
        json_answer=json_answer_,
        think=think,
        alternatives=() if json_answer_ else tuple(alternatives),
    )


def generate_corpus(
    n: int,
    split: Split = "train",
    seed: int = 0,
    mix: CorpusMix | None = None,
    word_pieces: Sequence[str] = (),
) -> list[Conversation]:
    """`n` conversations of `split`, deterministic in `(split, n, seed, mix, word_pieces)`; a longer corpus extends
    a shorter one. `word_pieces` (lowercase letter strings, e.g. a tokenizer's letter-only tokens) are building
    blocks for half of the training split's invented letter-counting words; the held-out split never invents."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if bad := [p for p in word_pieces if not (p.isascii() and p.isalpha() and p.islower())]:
        raise ValueError(f"word pieces must be lowercase ASCII letters, got {bad[:3]!r}")
    gen = _Generator(split, seed, mix or CorpusMix(), word_pieces)
    return [gen.conversation() for _ in range(n)]


def conversation_text(conv: Conversation) -> str:
    """All the text of a conversation (tool parts included), one message per line: tokenizer training input."""
    lines: list[str] = []
    for message in conv.messages:
        content = message["content"]
        lines.append(content if isinstance(content, str) else "".join(part["text"] for part in content))
    return "\n".join(lines)
