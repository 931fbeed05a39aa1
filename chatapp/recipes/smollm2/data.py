"""The default model's training and evaluation data: tool use, general answers, multi-turn recall.

Everything is generated from templates and word lists in this module with a seeded `random.Random`, so a recipe run
is reproducible offline. Held-out material is kept apart by construction, not by sampling luck:

- tool questions: held-out *phrasings* (templates never trained on) and held-out operand values / words;
- multi-step tool questions: held-out stories and phrasings, and one expression shape never trained;
- general questions: the evaluation's factual questions are never training prompts (training answers are the base
  model's own replies to other prompts, so nothing about the evaluation's answers is taught);
- recall: held-out names, numbers, cities and phrasings.

A tool turn is `recipes.chats`' calculator exchange (shared with the tiny recipe); the chat format writes it with the
model's tool markers.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from chatapp.recipes.chats import (
    LETTER_COUNT_ANSWERS,
    Calculation,
    Message,
    arithmetic,
    calculate,
    is_letter_count,
    letter_count,
    tool_exchange,
)


@dataclass(frozen=True)
class ToolQuestion:
    """A question whose answer needs the calculator: the expression it should call and the expected result."""

    question: str
    expression: str
    result: str
    kind: str  # "arithmetic", "word problem", "percent", "letters", "multi-step"

    @property
    def call(self) -> Calculation:
        return Calculation(self.expression, self.result)


@dataclass(frozen=True)
class FactQuestion:
    """A general question scored by keywords: right when the answer contains any of `keywords` (case-insensitive)."""

    question: str
    keywords: tuple[str, ...]


@dataclass(frozen=True)
class RecallConversation:
    """Three user turns: a fact to remember, an unrelated question, and the question that recalls the fact."""

    fact: str
    middle: str
    recall: str
    answer: str  # what the recall answer must contain


# ----------------------------------------------------------------------------------------------- arithmetic
# (template, operator). Operands are {a} and {b}; "{p}"/"{n}" for percentages.
_ARITH_TRAIN = [
    ("What is {a}*{b}?", "*"),
    ("What is {a} + {b}?", "+"),
    ("What is {a} - {b}?", "-"),
    ("What is {a} / {b}?", "/"),
    ("Calculate {a} times {b}.", "*"),
    ("Calculate {a} plus {b}.", "+"),
    ("Compute {a} minus {b}.", "-"),
    ("Compute {a} divided by {b}.", "/"),
    ("What's {a} multiplied by {b}?", "*"),
    ("Can you add {a} and {b} for me?", "+"),
    ("Please work out {a} x {b}.", "*"),
    ("Subtract {b} from {a}.", "-"),
    ("Add {a} and {b}.", "+"),
    ("Multiply {a} by {b}.", "*"),
    ("Divide {a} by {b}.", "/"),
    ("{a}*{b}=?", "*"),
    ("how much is {a}+{b}", "+"),
    ("What do you get if you multiply {a} and {b}?", "*"),
    ("Find {a} plus {b}.", "+"),
    ("What's {a} take away {b}?", "-"),
    ("I need {a} times {b}.", "*"),
    ("Can you divide {a} by {b}?", "/"),
    ("What is {a} multiplied by {b}?", "*"),
    ("Solve {a} - {b}.", "-"),
    ("{a} + {b} = ?", "+"),
    ("Help me with {a} x {b}, please.", "*"),
]
_ARITH_HELD_OUT = [
    ("What is {a} times {b}?", "*"),
    ("Work out {a} + {b}.", "+"),
    ("What is the product of {a} and {b}?", "*"),
    ("What is the sum of {a} and {b}?", "+"),
    ("How much is {a} minus {b}?", "-"),
    ("What is {a} divided by {b}?", "/"),
    ("Quick question: {a} * {b}?", "*"),
]

# Word problems: (template, expression builder, answer sentence).
_WordProblem = tuple[str, Callable[[int, int], str], str]
_WORD_TRAIN: list[_WordProblem] = [
    ("A box holds {a} apples. How many apples are in {b} boxes?", lambda a, b: f"{a}*{b}", "There are {r} apples."),
    (
        "Sam had {a} dollars and spent {b}. How much money does he have left?",
        lambda a, b: f"{a}-{b}",
        "He has {r} dollars left.",
    ),
    (
        "I have {a} marbles and my friend gives me {b} more. How many marbles do I have now?",
        lambda a, b: f"{a}+{b}",
        "You have {r} marbles now.",
    ),
    ("A car drives {a} km every day. How far does it go in {b} days?", lambda a, b: f"{a}*{b}", "It goes {r} km."),
    (
        "{a} cookies are shared equally among {b} children. How many cookies does each child get?",
        lambda a, b: f"{a}/{b}",
        "Each child gets {r} cookies.",
    ),
    (
        "A school has {a} boys and {b} girls. How many students are there in total?",
        lambda a, b: f"{a}+{b}",
        "There are {r} students in total.",
    ),
    (
        "A book has {a} pages and I have read {b}. How many pages are left?",
        lambda a, b: f"{a}-{b}",
        "{r} pages are left.",
    ),
    (
        "Tickets cost {a} dollars each. How much do {b} tickets cost?",
        lambda a, b: f"{a}*{b}",
        "{b} tickets cost {r} dollars.",
    ),
    (
        "A farmer has {a} eggs and packs them in cartons of {b}. How many cartons does he fill?",
        lambda a, b: f"{a}/{b}",
        "He fills {r} cartons.",
    ),
    (
        "There were {a} people at a concert and {b} left early. How many stayed?",
        lambda a, b: f"{a}-{b}",
        "{r} people stayed.",
    ),
    (
        "Mia collected {a} shells and lost {b} of them on the way home. How many shells does she still have?",
        lambda a, b: f"{a}-{b}",
        "She still has {r} shells.",
    ),
    (
        "A shop sold {a} shirts on Monday and {b} on Tuesday. How many shirts did it sell in total?",
        lambda a, b: f"{a}+{b}",
        "It sold {r} shirts.",
    ),
    (
        "Each crate weighs {a} kg. What do {b} crates weigh together?",
        lambda a, b: f"{a}*{b}",
        "They weigh {r} kg.",
    ),
    (
        "A rope {a} meters long is cut into {b} equal pieces. How long is each piece?",
        lambda a, b: f"{a}/{b}",
        "Each piece is {r} meters long.",
    ),
    (
        "Leo had {a} coins. He donated {b} coins to charity. How many coins are left?",
        lambda a, b: f"{a}-{b}",
        "Leo has {r} coins left.",
    ),
    (
        "A tank holds {a} liters and another {b} liters are poured in. How many liters are in the tank?",
        lambda a, b: f"{a}+{b}",
        "There are {r} liters in the tank.",
    ),
]
_WORD_HELD_OUT: list[_WordProblem] = [
    (
        "A baker makes {a} loaves a day. How many loaves does she make in {b} days?",
        lambda a, b: f"{a}*{b}",
        "She makes {r} loaves.",
    ),
    (
        "Tom has {a} stickers and gives away {b}. How many stickers does Tom have now?",
        lambda a, b: f"{a}-{b}",
        "Tom has {r} stickers.",
    ),
    (
        "{a} pencils are split evenly into {b} boxes. How many pencils go in each box?",
        lambda a, b: f"{a}/{b}",
        "Each box gets {r} pencils.",
    ),
    (
        "A library has {a} novels and buys {b} more. How many novels does it have?",
        lambda a, b: f"{a}+{b}",
        "It has {r} novels.",
    ),
    (
        "If one bus carries {a} passengers, how many passengers do {b} buses carry?",
        lambda a, b: f"{a}*{b}",
        "They carry {r} passengers.",
    ),
]
_PERCENT_TRAIN = [
    ("What is {p}% of {n}?", "{p}% of {n} is {r}."),
    ("What is {p} percent of {n}?", "{p} percent of {n} is {r}."),
    ("A jacket costs ${n} and is {p}% off. How much is the discount?", "The discount is ${r}."),
    ("Calculate {p}% of {n}.", "{p}% of {n} is {r}."),
    ("A restaurant bill is ${n}. How much is a {p}% tip?", "A {p}% tip is ${r}."),
    ("What's {p}% of {n}?", "It is {r}."),
    ("A {n} dollar bike is {p}% off. How much money is taken off?", "{r} dollars are taken off."),
    ("If I save {p}% of my {n} dollar salary, how much do I save?", "You save {r} dollars."),
    ("A town of {n} people grew by {p}%. How many new people is that?", "That is {r} new people."),
    ("Work out {p} percent of {n}.", "{p} percent of {n} is {r}."),
]
_PERCENT_HELD_OUT = [
    ("How much is {p}% of {n}?", "{p}% of {n} is {r}."),
    ("Find {p} percent of {n}.", "{p} percent of {n} is {r}."),
    ("A {n} dollar phone is on sale for {p}% off. How many dollars do I save?", "You save ${r}."),
]
_ARITH_ANSWERS = ["{a} {op} {b} = {r}.", "The answer is {r}.", "{a} {op} {b} is {r}.", "It is {r}."]

# --------------------------------------------------------------------------------------------- letter counts
_LETTER_TRAIN = [
    "How many {l}'s are in {w}?",
    "How many times does the letter {l} appear in {w}?",
    "Count the letter {l} in {w}.",
    "How many {l}s are there in the word {w}?",
    'How many times does "{l}" occur in "{w}"?',
    "In the word {w}, how many {l}'s are there?",
    "how many {l} in {w}",
    "Can you count the {l}'s in {w}?",
    "Find how many times {l} appears in {w}.",
    "How often does the letter {l} occur in the word {w}?",
    "Count how many {l}'s the word {w} has.",
    "What's the count of {l} in {w}?",
    "Number of {l}'s in {w}?",
    "I wonder how many {l}'s {w} contains.",
    "Does {w} have any {l}'s? How many?",
]
_LETTER_HELD_OUT = [
    "How many letter {l}'s does {w} have?",
    "What is the number of {l}'s in the word {w}?",
    "Tell me how many {l}'s are in {w}.",
    "How many r's are in strawberry?",  # the classic, kept whole
]
_LETTER_ANSWERS = [*LETTER_COUNT_ANSWERS, "{w} has {n} {c}'s."]

_WORDS_TRAIN = [
    "apple",
    "banana",
    "cherry",
    "orange",
    "lemon",
    "mango",
    "papaya",
    "grape",
    "melon",
    "peach",
    "pear",
    "plum",
    "kiwi",
    "coconut",
    "potato",
    "tomato",
    "carrot",
    "pepper",
    "onion",
    "garlic",
    "butter",
    "cheese",
    "bread",
    "coffee",
    "letter",
    "button",
    "mirror",
    "pillow",
    "window",
    "yellow",
    "purple",
    "silver",
    "rabbit",
    "monkey",
    "turtle",
    "parrot",
    "giraffe",
    "elephant",
    "hippopotamus",
    "kangaroo",
    "penguin",
    "dolphin",
    "squirrel",
    "gorilla",
    "mississippi",
    "tennessee",
    "massachusetts",
    "california",
    "pennsylvania",
    "committee",
    "balloon",
    "football",
    "baseball",
    "basketball",
    "volleyball",
    "umbrella",
    "calendar",
    "assessment",
    "possession",
    "necessary",
    "occasion",
    "accommodate",
    "embarrass",
    "millennium",
    "programming",
    "javascript",
    "keyboard",
    "computer",
    "telephone",
    "television",
    "newspaper",
    "chocolate",
    "strawberries",
    "raspberry",
    "blueberry",
    "cranberry",
    "pineapple",
    "avocado",
    "broccoli",
    "spaghetti",
    "vanilla",
    "cinnamon",
    "dinosaur",
    "butterfly",
    "caterpillar",
    "grasshopper",
]
_WORDS_HELD_OUT = [
    "strawberry",
    "bookkeeper",
    "parallel",
    "coffee",
    "mississippi",
    "banana",
    "peppermint",
    "assassin",
    "referee",
    "tomorrow",
    "engineering",
    "address",
    "success",
    "occurrence",
    "sleepless",
    "cheerleader",
    "difficult",
    "principal",
    "reservoir",
    "hummingbird",
]
# Held-out words may repeat training words: a count of a known word under an unseen phrasing is still held out by
# phrasing; most are new words.


def _letter_for(rng: random.Random, word: str) -> str:
    """Mostly a letter of the word (favouring repeated ones), sometimes one it lacks (answer 0)."""
    if rng.random() < 0.12:
        absent = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in word]
        return rng.choice(absent)
    letters = sorted(set(word), key=lambda c: (-word.count(c), c))
    return rng.choice(letters[:3])


def _operands(rng: random.Random, op: str) -> tuple[int, int]:
    if op == "/":
        b = rng.randint(2, 40)
        return b * rng.randint(2, 60), b
    if op == "-":
        a = rng.randint(10, 999)
        return a, rng.randint(1, a)
    return rng.randint(2, 999), rng.randint(2, 999)


_OP_WORDS = {"*": "×", "+": "+", "-": "-", "/": "÷"}


# The held-out set's mix (the evaluation's numbers compare across recipes only while it stays this).
EVAL_KINDS = ("arithmetic", "word problem", "percent", "letters", "letters")
# Training's mix: word problems twice, as they are the weakest kind (the model picks the wrong operation).
TRAIN_KINDS = ("arithmetic", "word problem", "word problem", "percent", "letters", "letters")


def tool_questions(
    rng: random.Random, count: int, held_out: bool, kinds: tuple[str, ...] = EVAL_KINDS
) -> list[tuple[ToolQuestion, str]]:
    """`count` tool questions with an answer sentence each, cycling over `kinds`; held-out phrasings when asked."""
    arith = _ARITH_HELD_OUT if held_out else _ARITH_TRAIN
    words = _WORD_HELD_OUT if held_out else _WORD_TRAIN
    percents = _PERCENT_HELD_OUT if held_out else _PERCENT_TRAIN
    letters = _LETTER_HELD_OUT if held_out else _LETTER_TRAIN
    vocab = _WORDS_HELD_OUT if held_out else _WORDS_TRAIN
    out: list[tuple[ToolQuestion, str]] = []
    for index in range(count):
        kind = kinds[index % len(kinds)]
        if kind == "arithmetic":
            template, op = rng.choice(arith)
            a, b = _operands(rng, op)
            call = arithmetic(a, op, b)
            answer = rng.choice(_ARITH_ANSWERS).format(a=a, b=b, op=_OP_WORDS[op], r=call.result)
            question = template.format(a=a, b=b)
        elif kind == "word problem":
            template, build, sentence = rng.choice(words)
            op = build(7, 3)[1]
            a, b = _operands(rng, op)
            call = calculate(build(a, b))
            question, answer = template.format(a=a, b=b), sentence.format(a=a, b=b, r=call.result)
        elif kind == "percent":
            template, sentence = rng.choice(percents)
            p = rng.choice([5, 10, 12, 15, 18, 20, 25, 30, 40, 50, 75, 8, 3, 35, 60])
            n = rng.choice([rng.randint(2, 99) * 10, rng.randint(10, 999), rng.randint(1, 40) * 25])
            call = calculate(f"{n}*{p}/100")
            question, answer = template.format(p=p, n=n), sentence.format(p=p, n=n, r=call.result)
        else:
            template = rng.choice(letters)
            if "strawberry" in template:
                word, letter = "strawberry", "r"
            else:
                word = rng.choice(vocab)
                letter = _letter_for(rng, word)
            call = letter_count(word, letter)
            question = template.format(l=letter, w=word)
            answer = rng.choice(_LETTER_ANSWERS).format(n=call.result, c=letter, w=word)
        out.append((ToolQuestion(question, call.expression, call.result, kind), answer))
    return out


def tool_conversation(item: ToolQuestion, answer: str) -> list[Message]:
    """The question and an answer that calls the calculator straight away."""
    return tool_exchange(item.question, item.call, answer)


# -------------------------------------------------------------------------------------------- multi-step
# Word problems whose one calculator call is the whole problem: several operations, parentheses, a unit factor.
# The model tends to call only the last step ("24-17" for three boxes of 24 less 17) or to drop parentheses, so the
# expression is the canonical one to write: no spaces, operands in the question's order where natural, unit factors
# as plain numbers ("15*7*3" for 15 a day for 3 weeks).
#
# The held-out templates are stories and wordings no training template has, of the trained structures and unit
# factors (7 days, 24 hours, 60 minutes, 12 months, 52 weeks, 100 cents, 1000 meters), and one structure never
# trained (two bracketed sums multiplied): the evaluation measures whether a call carries over to a new problem,
# not recall of a template. Held out by unit as well, the first refining run wrote `12*7` for the hours in 12 days.
#
# (template, expression builder, answer sentence, operand ranges). Operands are {a}, {b}, {c}, {d} in the ranges'
# order; draws are redrawn until the result is a positive whole number and no number in the expression repeats (a
# unit factor included), so where each operand goes can be checked.
_MultiStep = tuple[str, Callable[..., str], str, tuple[tuple[int, int], ...]]
_MULTI_TRAIN: list[_MultiStep] = [
    (
        "A shelf holds {a} rows of {b} books. If {c} books are taken out, how many books are left?",
        lambda a, b, c: f"{a}*{b}-{c}",
        "{r} books are left.",
        ((2, 9), (5, 30), (2, 40)),
    ),
    (
        "Nina buys {a} packs of {b} stickers and gives {c} stickers to her brother. How many stickers does she have?",
        lambda a, b, c: f"{a}*{b}-{c}",
        "She has {r} stickers.",
        ((2, 9), (5, 30), (2, 40)),
    ),
    (
        "Notebooks cost {a} dollars each. I buy {b} of them with a coupon for {c} dollars off. How much do I pay?",
        lambda a, b, c: f"{a}*{b}-{c}",
        "You pay {r} dollars.",
        ((3, 25), (2, 9), (2, 20)),
    ),
    (
        "A theater has {a} rows of {b} seats plus {c} extra chairs. How many people can sit down?",
        lambda a, b, c: f"{a}*{b}+{c}",
        "{r} people can sit down.",
        ((5, 30), (8, 40), (2, 20)),
    ),
    (
        "I buy {a} apples at {b} cents each and {c} pears at {d} cents each. How many cents do I spend?",
        lambda a, b, c, d: f"{a}*{b}+{c}*{d}",
        "You spend {r} cents.",
        ((2, 12), (20, 99), (2, 12), (20, 99)),
    ),
    (
        "A farm has {a} pens with {b} sheep each and {c} pens with {d} goats each. How many animals are there?",
        lambda a, b, c, d: f"{a}*{b}+{c}*{d}",
        "There are {r} animals.",
        ((2, 9), (5, 30), (2, 9), (5, 30)),
    ),
    ("Calculate ({a}+{b})*{c}.", lambda a, b, c: f"({a}+{b})*{c}", "({a}+{b})*{c} = {r}.", ((2, 60), (2, 60), (2, 12))),
    (
        "{a} adults and {b} children each pay {c} dollars for a boat ride. How much do they pay in total?",
        lambda a, b, c: f"({a}+{b})*{c}",
        "They pay {r} dollars.",
        ((2, 30), (2, 30), (3, 25)),
    ),
    (
        "Each day I read {a} pages in the morning and {b} pages at night. How many pages do I read in {c} days?",
        lambda a, b, c: f"({a}+{b})*{c}",
        "You read {r} pages.",
        ((3, 30), (3, 30), (2, 30)),
    ),
    (
        "A runner runs {a} km a day. How far does she run in {b} weeks?",
        lambda a, b: f"{a}*7*{b}",
        "She runs {r} km.",
        ((2, 20), (2, 12)),
    ),
    (
        "I practice the piano for {a} minutes every day. How many minutes is that in {b} weeks?",
        lambda a, b: f"{a}*7*{b}",
        "That is {r} minutes.",
        ((10, 60), (2, 8)),
    ),
    ("How many minutes are in {a} hours?", lambda a: f"{a}*60", "{a} hours are {r} minutes.", ((2, 48),)),
    (
        "A movie lasts {a} hours and {b} minutes. How many minutes long is it?",
        lambda a, b: f"{a}*60+{b}",
        "It is {r} minutes long.",
        ((2, 5), (5, 59)),
    ),
    (
        "A machine makes {a} parts every minute. How many parts does it make in {b} hours?",
        lambda a, b: f"{a}*60*{b}",
        "It makes {r} parts.",
        ((2, 30), (2, 12)),
    ),
    (
        "A class has {a} students. {b} are absent and the rest form groups of {c}. How many groups are there?",
        lambda a, b, c: f"({a}-{b})/{c}",
        "There are {r} groups.",
        ((12, 60), (2, 10), (2, 8)),
    ),
    ("Compute ({a}-{b})/{c}.", lambda a, b, c: f"({a}-{b})/{c}", "({a}-{b})/{c} = {r}.", ((20, 99), (2, 40), (2, 12))),
    (
        "{a} red and {b} blue balloons are shared equally by {c} kids. How many balloons does each kid get?",
        lambda a, b, c: f"({a}+{b})/{c}",
        "Each kid gets {r} balloons.",
        ((5, 40), (5, 40), (2, 9)),
    ),
    (
        "A hotel has {a} floors with {b} rooms each, and every room has {c} windows. How many windows are there?",
        lambda a, b, c: f"{a}*{b}*{c}",
        "There are {r} windows.",
        ((2, 20), (4, 30), (2, 6)),
    ),
    (
        "A bus has {a} passengers. At a stop {b} get on and {c} get off. How many passengers are on the bus now?",
        lambda a, b, c: f"{a}+{b}-{c}",
        "There are {r} passengers on the bus.",
        ((10, 60), (2, 20), (2, 30)),
    ),
    (
        "I had {a} dollars. I spent {b} on lunch and {c} on a book. How much money is left?",
        lambda a, b, c: f"{a}-{b}-{c}",
        "You have {r} dollars left.",
        ((40, 99), (5, 30), (5, 40)),
    ),
    ("Work out {a}*{b}+{c}.", lambda a, b, c: f"{a}*{b}+{c}", "{a}*{b}+{c} = {r}.", ((2, 30), (2, 30), (2, 60))),
    (
        "What do you get for {a}+{b}*{c}?",
        lambda a, b, c: f"{a}+{b}*{c}",
        "{a}+{b}*{c} = {r}.",
        ((2, 60), (2, 20), (2, 20)),
    ),
    (
        "{a} candies are packed {b} to a bag, and each bag sells for {c} dollars. How much do all the bags bring in?",
        lambda a, b, c: f"{a}/{b}*{c}",
        "They bring in {r} dollars.",
        ((12, 60), (2, 12), (2, 9)),
    ),
    (
        "{a} apples, {b} pears and {c} plums are shared equally among {d} baskets. How many fruits go in each basket?",
        lambda a, b, c, d: f"({a}+{b}+{c})/{d}",
        "Each basket gets {r} fruits.",
        ((3, 30), (3, 30), (3, 30), (2, 6)),
    ),
    # The shapes and units the held-out set asks, in other stories: a call is learned as a structure and a unit as
    # a factor, and a 135M model does not invent either from a story it never saw (the first refining run trained
    # only 7 and 60 and wrote `12*7` for the hours in 12 days).
    (
        "A garden has {a} beds. Each bed has {b} roses and {c} tulips. How many flowers are there?",
        lambda a, b, c: f"{a}*({b}+{c})",
        "There are {r} flowers.",
        ((2, 20), (2, 9), (2, 9)),
    ),
    (
        "A ticket costs {a} dollars and members get {b} dollars off. How much do {c} members pay?",
        lambda a, b, c: f"({a}-{b})*{c}",
        "They pay {r} dollars.",
        ((15, 60), (2, 14), (2, 9)),
    ),
    (
        "{a} crates of {b} oranges are split equally among {c} shops. How many oranges does each shop get?",
        lambda a, b, c: f"{a}*{b}/{c}",
        "Each shop gets {r} oranges.",
        ((2, 12), (4, 24), (2, 9)),
    ),
    ("How many hours are there in {a} days?", lambda a: f"{a}*24", "There are {r} hours in {a} days.", ((2, 30),)),
    (
        "A candle burns {a} mm an hour. How many mm does it burn in {b} days?",
        lambda a, b: f"{a}*24*{b}",
        "It burns {r} mm.",
        ((2, 30), (2, 9)),
    ),
    ("How many months are in {a} years?", lambda a: f"{a}*12", "{a} years are {r} months.", ((2, 40),)),
    (
        "My phone plan costs {a} dollars a month. How much is that for {b} years?",
        lambda a, b: f"{a}*12*{b}",
        "That is {r} dollars.",
        ((3, 40), (2, 9)),
    ),
    (
        "A club meets {a} times a week. How many meetings is that in {b} years?",
        lambda a, b: f"{a}*52*{b}",
        "That is {r} meetings.",
        ((2, 6), (2, 9)),
    ),
    (
        "A book costs {a} dollars and {b} cents. How many cents does it cost?",
        lambda a, b: f"{a}*100+{b}",
        "It costs {r} cents.",
        ((2, 60), (5, 99)),
    ),
    (
        "A race is {a} km long and a runner has done {b} meters. How many meters does she still have to run?",
        lambda a, b: f"{a}*1000-{b}",
        "She has {r} meters to go.",
        ((2, 40), (100, 900)),
    ),
    (
        "A baker makes {a} trays of {b} rolls and sells {c} bags of {d} rolls. How many rolls are left?",
        lambda a, b, c, d: f"{a}*{b}-{c}*{d}",
        "{r} rolls are left.",
        ((5, 20), (6, 30), (2, 12), (2, 9)),
    ),
    (
        "A jar had {a} coins. I added {b} and then {c} more, and took out {d}. How many coins are in the jar?",
        lambda a, b, c, d: f"{a}+{b}+{c}-{d}",
        "There are {r} coins in the jar.",
        ((5, 40), (5, 40), (5, 40), (2, 30)),
    ),
    (
        "{a} stickers are shared equally among {b} girls and {c} boys. How many stickers does each child get?",
        lambda a, b, c: f"{a}/({b}+{c})",
        "Each child gets {r} stickers.",
        ((12, 60), (2, 9), (2, 9)),
    ),
    ("Calculate {a}*({b}-{c}).", lambda a, b, c: f"{a}*({b}-{c})", "{a}*({b}-{c}) = {r}.", ((2, 12), (10, 60), (2, 9))),
]
_MULTI_HELD_OUT: list[_MultiStep] = [
    (
        "A café has {a} tables. Each table has {b} chairs and {c} stools. How many seats are there?",
        lambda a, b, c: f"{a}*({b}+{c})",
        "There are {r} seats.",
        ((2, 20), (2, 8), (2, 8)),
    ),
    (
        "A shirt costs {a} dollars, and in the sale it is {b} dollars cheaper. How much do {c} shirts cost in the sale?",
        lambda a, b, c: f"({a}-{b})*{c}",
        "{c} shirts cost {r} dollars.",
        ((15, 60), (2, 14), (2, 9)),
    ),
    (
        "{a} boxes of {b} muffins are shared equally among {c} classes. How many muffins does each class get?",
        lambda a, b, c: f"{a}*{b}/{c}",
        "Each class gets {r} muffins.",
        ((2, 12), (4, 24), (2, 9)),
    ),
    ("How many hours are in {a} days?", lambda a: f"{a}*24", "{a} days are {r} hours.", ((2, 30),)),
    (
        "A pump moves {a} liters an hour. How many liters does it move in {b} days?",
        lambda a, b: f"{a}*24*{b}",
        "It moves {r} liters.",
        ((2, 40), (2, 9)),
    ),
    (
        "Ana pays {a} dollars a month for music. How much does she pay in {b} years?",
        lambda a, b: f"{a}*12*{b}",
        "She pays {r} dollars.",
        ((3, 30), (2, 9)),
    ),
    (
        "I save {a} dollars every week. How much do I save in {b} years?",
        lambda a, b: f"{a}*52*{b}",
        "You save {r} dollars.",
        ((2, 40), (2, 6)),
    ),
    (
        "A toy costs {a} dollars and {b} cents. How many cents is that?",
        lambda a, b: f"{a}*100+{b}",
        "That is {r} cents.",
        ((2, 60), (5, 99)),
    ),
    (
        "A trail is {a} km long and I have walked {b} meters. How many meters are left?",
        lambda a, b: f"{a}*1000-{b}",
        "{r} meters are left.",
        ((2, 20), (100, 900)),
    ),
    (
        "A school orders {a} boxes of {b} pencils and hands out {c} pencils to each of {d} classes. "
        "How many pencils are left?",
        lambda a, b, c, d: f"{a}*{b}-{c}*{d}",
        "{r} pencils are left.",
        ((5, 20), (6, 30), (2, 12), (2, 9)),
    ),
    (
        "A library got {a} books on Monday, {b} on Tuesday and {c} on Wednesday, then lent out {d} of them. "
        "How many of the new books are still there?",
        lambda a, b, c, d: f"{a}+{b}+{c}-{d}",
        "{r} of the new books are still there.",
        ((5, 40), (5, 40), (5, 40), (2, 30)),
    ),
    (
        "{a} cookies are shared equally among {b} boys and {c} girls. How many cookies does each child get?",
        lambda a, b, c: f"{a}/({b}+{c})",
        "Each child gets {r} cookies.",
        ((12, 60), (2, 9), (2, 9)),
    ),
    ("What is {a}*({b}-{c})?", lambda a, b, c: f"{a}*({b}-{c})", "{a}*({b}-{c}) = {r}.", ((2, 12), (10, 60), (2, 9))),
    (
        "Find ({a}-{b})*({c}+{d}).",
        lambda a, b, c, d: f"({a}-{b})*({c}+{d})",
        "({a}-{b})*({c}+{d}) = {r}.",
        ((10, 60), (2, 9), (2, 12), (2, 12)),
    ),
]
_OPERAND_NAMES = "abcd"


def _exact(node: ast.expr) -> Fraction | None:
    """The value of an expression tree, or None when some division in it leaves a remainder (a whole result can
    still hide one: 24/10*5) or some step goes below zero."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return Fraction(node.value)
    if not isinstance(node, ast.BinOp):
        raise ValueError(f"not a multi-step expression: {ast.dump(node)}")
    left, right = _exact(node.left), _exact(node.right)
    if left is None or right is None:
        return None
    if isinstance(node.op, ast.Div):
        return left / right if right and (left / right).denominator == 1 else None
    value = {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right}[type(node.op)]
    return value if value > 0 else None


def _multistep(rng: random.Random, problem: _MultiStep) -> tuple[ToolQuestion, str]:
    """One question from `problem`: operands redrawn until the result is a positive whole number and every number in
    the expression is distinct."""
    template, build, sentence, ranges = problem
    for _ in range(10_000):
        operands = [rng.randint(low, high) for low, high in ranges]
        expression = build(*operands)
        numbers = re.findall(r"\d+", expression)
        if len(set(numbers)) < len(numbers) or not _exact(ast.parse(expression, mode="eval").body):
            continue
        call = calculate(expression)
        if call.result.isdigit() and int(call.result) > 0:
            names = dict(zip(_OPERAND_NAMES, operands, strict=False))
            question = template.format(**names)
            answer = sentence.format(r=call.result, **names)
            return ToolQuestion(question, call.expression, call.result, "multi-step"), answer
    raise ValueError(f"no operands fit {template!r}")


def multistep_questions(rng: random.Random, count: int, held_out: bool) -> list[tuple[ToolQuestion, str]]:
    """`count` multi-step word problems with an answer sentence each; the templates go round in a shuffled order, so
    each is used about as often as the others. Held-out templates when asked: stories never trained, of the
    trained structures and units but one (two bracketed sums multiplied)."""
    problems = _MULTI_HELD_OUT if held_out else _MULTI_TRAIN
    out: list[tuple[ToolQuestion, str]] = []
    order: list[_MultiStep] = []
    for _ in range(count):
        if not order:
            order = rng.sample(problems, len(problems))
        out.append(_multistep(rng, order.pop()))
    return out


# Share of chained conversations that switch between a numeric call and a letter count (see below).
SWITCH_SHARE = 0.4


def chained_conversations(
    rng: random.Random, count: int, tools: list[list[Message]], general: list[list[Message]]
) -> list[list[Message]]:
    """`count` conversations of 2-3 exchanges drawn from single-exchange `tools` and `general` ones: tool questions
    in a row and tool and general turns interleaved. Each call must come from its own question: a model that only
    ever saw one tool exchange per conversation learns to repeat the call already in its context.

    `SWITCH_SHARE` of them are switches: a letter count asked after a numeric call, or the other way round, with
    a general exchange between them a third of the time. A letter count after arithmetic is the measured weak
    spot (the model repeated the arithmetic call), so that direction gets three in four switches."""
    letters = [t for t in tools if _is_letter_count(t)]
    numeric = [t for t in tools if not _is_letter_count(t)]
    out = []
    for _ in range(count):
        if letters and numeric and rng.random() < SWITCH_SHARE:
            first, second = (numeric, letters) if rng.random() < 0.75 else (letters, numeric)
            picks = [rng.choice(first), rng.choice(second)]
            if general and rng.random() < 1 / 3:
                picks.insert(1, rng.choice(general))
        else:
            turns = rng.choice([2, 2, 3])
            picks = [rng.choice(tools if rng.random() < 0.7 else general) for _ in range(turns)]
            if not any(p in tools for p in picks):
                picks[rng.randrange(turns)] = rng.choice(tools)
        out.append([message for exchange in picks for message in exchange])
    return out


def _is_letter_count(exchange: list[Message]) -> bool:
    content = exchange[1]["content"]
    return isinstance(content, list) and is_letter_count(content[0]["text"])


# ------------------------------------------------------------------------------------------------- general
_COUNTRIES_TRAIN = [
    "Germany",
    "Italy",
    "Spain",
    "Portugal",
    "Canada",
    "Mexico",
    "Brazil",
    "Argentina",
    "Egypt",
    "Kenya",
    "India",
    "China",
    "Russia",
    "Greece",
    "Sweden",
    "Norway",
    "Poland",
    "Turkey",
    "Ireland",
    "Austria",
    "Peru",
    "Chile",
    "Cuba",
    "Vietnam",
    "Thailand",
    "Nigeria",
    "Morocco",
    "Belgium",
    "Denmark",
    "Finland",
]
_TOPICS = [
    "photosynthesis",
    "gravity",
    "electricity",
    "democracy",
    "inflation",
    "the internet",
    "vaccines",
    "volcanoes",
    "rainbows",
    "earthquakes",
    "black holes",
    "the water cycle",
    "recycling",
    "machine learning",
    "the stock market",
    "evolution",
    "tides",
    "the immune system",
    "climate change",
    "nuclear energy",
    "the moon",
    "friction",
    "magnetism",
    "DNA",
    "solar panels",
    "clouds",
    "sleep",
    "exercise",
    "music",
    "coffee",
    "bees",
    "the ocean",
    "the Roman Empire",
    "the printing press",
    "airplanes",
    "batteries",
    "bread",
    "chess",
    "soccer",
    "robots",
]
_THINGS = [
    "the sea",
    "autumn",
    "a cat",
    "the city at night",
    "friendship",
    "a rainy day",
    "coffee",
    "the mountains",
    "a lost key",
    "spring flowers",
    "the stars",
    "an old library",
    "winter",
    "a dog",
    "a summer garden",
    "the moon",
    "a train journey",
    "a lighthouse",
    "snow",
    "a bicycle",
]
_ACTIVITIES = [
    "studying for exams",
    "sleeping better",
    "learning to cook",
    "saving money",
    "running a marathon",
    "staying focused",
    "learning a new language",
    "public speaking",
    "keeping a plant alive",
    "writing an essay",
    "making friends in a new city",
    "travelling on a budget",
    "starting to exercise",
    "reading more books",
    "a job interview",
    "taking better photos",
    "staying hydrated",
    "learning to code",
    "cleaning a kitchen",
    "planning a party",
]
_GENERAL_TEMPLATES = [
    "What is the capital of {country}?",
    "Explain {topic} in simple terms.",
    "What is {topic}?",
    "Tell me an interesting fact about {topic}.",
    "Write a short poem about {thing}.",
    "Write a haiku about {thing}.",
    "Give me three tips for {activity}.",
    "How can I get better at {activity}?",
    "Tell me a short story about {thing}.",
    "Describe {thing} in two sentences.",
    "Why is {topic} important?",
    "Summarize what you know about {topic} in one sentence.",
    "How does {topic} work?",
    "Explain {topic} to a five-year-old.",
    "What are three facts about {topic}?",
    "Write a limerick about {thing}.",
    "What are the benefits of {activity}?",
]
_SMALL_TALK = [
    "Hi!",
    "Hello, how are you?",
    "Good morning!",
    "Thank you!",
    "What can you do?",
    "Who are you?",
    "Tell me a joke.",
    "Can you help me?",
    "What's your name?",
    "Thanks, that was helpful.",
    "Goodbye!",
    "I'm feeling a bit bored. Any ideas?",
    "What should I cook for dinner tonight?",
    "Recommend a good book.",
    "What is a good name for a pet goldfish?",
    "How do I make a cup of tea?",
    "What is the meaning of life?",
    "Can you write a limerick?",
    "How do I say thank you in Spanish?",
    "What day comes after Monday?",
    "Is it better to study in the morning or at night?",
    "Give me a fun fact.",
    "What is your favorite color?",
    "Tell me a story about a dragon.",
    "Write a sentence using the word 'serendipity'.",
]


# Questions that read like a calculator's ("How many ...?") but ask what the model knows: their distilled answers
# teach that a count of things in the world is not a letter count. The base model often gets these wrong ("A bicycle
# has 5 wheels."), so only answers containing the right number train (rejection sampling: the model learns from its
# own correct answers). None is an evaluation question (a test checks).
COUNTING_PROMPTS: dict[str, tuple[str, ...]] = {
    q: tuple(k.split("|"))
    for q, k in [
        ("How many wheels does a bicycle have?", "two|2"),
        ("How many players are on a soccer team?", "eleven|11"),
        ("How many legs does a dog have?", "four|4"),
        ("How many planets are in our solar system?", "eight|8"),
        ("How many minutes are in an hour?", "sixty|60"),
        ("How many seconds are in a minute?", "sixty|60"),
        ("How many weeks are in a year?", "52|fifty-two"),
        ("How many strings does a guitar usually have?", "six|6"),
        ("How many colors are in a rainbow?", "seven|7"),
        ("How many wings does a bird have?", "two|2"),
        ("How many sides does a square have?", "four|4"),
        ("How many letters are in the English alphabet?", "26|twenty-six"),
        ("How many bones does an adult human have?", "206"),
        ("How many teeth does an adult usually have?", "32|thirty-two"),
        ("How many days are in a leap year?", "366"),
        ("How many arms does an octopus have?", "eight|8"),
        ("How many oceans are there on Earth?", "five|5"),
        ("How many hearts does an octopus have?", "three|3"),
        ("How many eyes does a spider usually have?", "eight|8"),
        ("How many states are in the United States?", "50|fifty"),
        ("How many sides does a hexagon have?", "six|6"),
        ("How many centimeters are in a meter?", "100|hundred"),
        ("How many grams are in a kilogram?", "1000|1,000|thousand"),
        ("How many legs does an insect have?", "six|6"),
        ("How many sides does a pentagon have?", "five|5"),
        ("How many days are in a year?", "365"),
        ("How many legs does a cat have?", "four|4"),
        ("How many fingers are on one hand?", "five|5"),
        ("How many wheels does a car have?", "four|4"),
        ("How many eyes do people have?", "two|2"),
    ]
}


def answer_is_right(prompt: str, answer: str) -> bool:
    """False for a distilled answer to a counting prompt that misses its number; True for every other prompt."""
    keywords = COUNTING_PROMPTS.get(prompt)
    return keywords is None or any(k.lower() in answer.lower() for k in keywords)


def repetitive(text: str) -> bool:
    """A greedy answer caught in a loop: some line said three times, or some 6-word run four times."""
    lines = [line.strip() for line in text.splitlines() if len(line.strip()) > 10]
    if any(lines.count(line) >= 3 for line in set(lines)):
        return True
    words = text.split()
    runs = [" ".join(words[i : i + 6]) for i in range(len(words) - 5)]
    return any(runs.count(run) >= 4 for run in set(runs))


def general_prompts(rng: random.Random, count: int) -> list[str]:
    """Varied prompts for the base model to answer (its answers become the general training data)."""
    prompts = list(_SMALL_TALK)
    seen = set(prompts)
    for _ in range(50 * count):
        if len(prompts) >= count:
            break
        template = rng.choice(_GENERAL_TEMPLATES)
        prompt = template.format(
            country=rng.choice(_COUNTRIES_TRAIN),
            topic=rng.choice(_TOPICS),
            thing=rng.choice(_THINGS),
            activity=rng.choice(_ACTIVITIES),
        )
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    rng.shuffle(prompts)
    return prompts[:count]


# Held-out general questions with keyword answers. None of these is a training prompt (checked by a test), and the
# capitals asked here are of countries the training prompts never name. The model card's early rows scored the first
# `FACT_QUESTIONS_FIRST` alone; the evaluation reports them apart as well, so those rows stay comparable.
FACT_QUESTIONS_FIRST = 60
FACT_QUESTIONS: tuple[FactQuestion, ...] = tuple(
    FactQuestion(q, tuple(k.split("|")))
    for q, k in [
        ("What is the capital of France?", "Paris"),
        ("What is the capital of Japan?", "Tokyo"),
        ("What is the capital of England?", "London"),
        ("What is the capital of Australia?", "Canberra"),
        ("What is the capital of the United States?", "Washington"),
        ("What is the capital of Netherlands?", "Amsterdam"),
        ("What is the capital of Switzerland?", "Bern"),
        ("What is the capital of South Korea?", "Seoul"),
        ("What is the capital of Hungary?", "Budapest"),
        ("What is the capital of Colombia?", "Bogot"),
        ("What is the largest planet in our solar system?", "Jupiter"),
        ("Which planet is known as the Red Planet?", "Mars"),
        ("What planet do we live on?", "Earth"),
        ("What is the closest star to Earth?", "Sun"),
        ("What color is the sky on a clear day?", "blue"),
        ("What color are bananas when they are ripe?", "yellow"),
        ("What color is grass?", "green"),
        ("How many days are there in a week?", "seven|7"),
        ("How many legs does a spider have?", "eight|8"),
        ("How many continents are there?", "seven|7"),
        ("How many sides does a triangle have?", "three|3"),
        ("How many hours are in a day?", "24|twenty-four"),
        ("How many months are in a year?", "12|twelve"),
        ("What is the freezing point of water in Celsius?", "0|zero"),
        ("What is the boiling point of water in Celsius?", "100"),
        ("What is the chemical symbol for water?", "H2O|H₂O"),
        ("What gas do plants absorb from the air?", "carbon dioxide|CO2"),
        ("What gas do humans need to breathe?", "oxygen"),
        ("Who wrote Romeo and Juliet?", "Shakespeare"),
        ("Who painted the Mona Lisa?", "Leonardo|Vinci"),
        ("Who developed the theory of relativity?", "Einstein"),
        ("Who was the first president of the United States?", "Washington"),
        ("What is the largest ocean on Earth?", "Pacific"),
        ("What is the longest river in Africa?", "Nile"),
        ("What is the tallest mountain in the world?", "Everest"),
        ("What is the largest desert in Africa?", "Sahara"),
        ("What is the largest mammal?", "whale"),
        ("What animal is known as the king of the jungle?", "lion"),
        ("What do bees make?", "honey"),
        ("What do caterpillars turn into?", "butterfl|moth"),
        ("What is the opposite of hot?", "cold"),
        ("What is the opposite of up?", "down"),
        ("What is the plural of mouse?", "mice"),
        ("What language is spoken in Brazil?", "Portuguese"),
        ("What language is spoken in Mexico?", "Spanish"),
        ("What is the main ingredient in guacamole?", "avocado"),
        ("What do you call a baby dog?", "puppy|puppies"),
        ("What do you call a baby cat?", "kitten"),
        ("What is frozen water called?", "ice"),
        ("Which organ pumps blood through the body?", "heart"),
        ("What is the hardest natural substance?", "diamond"),
        ("What is the currency of Japan?", "yen"),
        ("What is the currency of the United Kingdom?", "pound"),
        ("In which country are the pyramids of Giza?", "Egypt"),
        ("What instrument has 88 keys?", "piano"),
        ("What shape has four equal sides and four right angles?", "square"),
        ("What is the first letter of the English alphabet?", "A"),
        ("Translate 'hello' into French.", "bonjour"),
        ("What season comes after winter?", "spring"),
        ("What is the primary language of the United States?", "English"),
        # The first 60 end here; the rest make the set large enough that one model's score against another's
        # means something (at 60 questions a single answer moves the rate by 1.7 points).
        ("What is the capital of New Zealand?", "Wellington"),
        ("What is the capital of the Czech Republic?", "Prague"),
        ("What is the capital of the Philippines?", "Manila"),
        ("What is the capital of Indonesia?", "Jakarta"),
        ("What is the capital of Saudi Arabia?", "Riyadh"),
        ("What is the capital of Iran?", "Tehran"),
        ("What is the capital of Iraq?", "Baghdad"),
        ("What is the capital of Pakistan?", "Islamabad"),
        ("What is the capital of Ukraine?", "Kyiv|Kiev"),
        ("What is the capital of Romania?", "Bucharest"),
        ("What is the capital of Scotland?", "Edinburgh"),
        ("What is the capital of Afghanistan?", "Kabul"),
        ("What is the capital of Malaysia?", "Kuala Lumpur"),
        ("What is the capital of Iceland?", "Reykjav"),
        ("What is the capital of Venezuela?", "Caracas"),
        ("What is the capital of Ghana?", "Accra"),
        ("What is the capital of Ethiopia?", "Addis Ababa"),
        ("What is the capital of Jamaica?", "Kingston"),
        ("What is the capital of Bangladesh?", "Dhaka"),
        ("What is the capital of Nepal?", "Kathmandu"),
        ("What is the capital of Lebanon?", "Beirut"),
        ("What is the capital of Syria?", "Damascus"),
        ("What is the capital of Serbia?", "Belgrade"),
        ("What is the largest organ of the human body?", "skin"),
        ("What is the center of an atom called?", "nucleus"),
        ("What is H2O commonly called?", "water"),
        ("What is the smallest planet in our solar system?", "Mercury"),
        ("Which planet is famous for its rings?", "Saturn"),
        ("What is the hottest planet in our solar system?", "Venus"),
        ("What galaxy do we live in?", "Milky Way"),
        ("What is the powerhouse of the cell?", "mitochondri"),
        ("What does DNA stand for?", "deoxyribonucleic"),
        ("What is the study of living things called?", "biology"),
        ("What is the study of stars and planets called?", "astronomy"),
        ("What is the study of rocks called?", "geology"),
        ("Which organ do we use to breathe?", "lung"),
        ("Which organ do we think with?", "brain"),
        ("How many chambers does the human heart have?", "four|4"),
        ("What is the longest bone in the human body?", "femur|thigh"),
        ("Which vitamin does our skin make from sunlight?", "vitamin d"),
        ("Which blood cells fight infection?", "white"),
        ("What is the most common gas in Earth's atmosphere?", "nitrogen"),
        ("What is the chemical name for table salt?", "sodium chloride|NaCl"),
        ("Which metal is liquid at room temperature?", "mercury"),
        ("What is the boiling point of water in Fahrenheit?", "212"),
        ("What is the freezing point of water in Fahrenheit?", "32"),
        ("What kind of animal is a whale?", "mammal"),
        ("What kind of animal is a frog?", "amphibian"),
        ("What kind of animal is a snake?", "reptile"),
        ("What is a baby cow called?", "calf"),
        ("What is a baby sheep called?", "lamb"),
        ("What is a baby kangaroo called?", "joey"),
        ("What is a group of lions called?", "pride"),
        ("What is a group of wolves called?", "pack"),
        ("What is the largest land animal?", "elephant"),
        ("What is the fastest land animal?", "cheetah"),
        ("What is the tallest animal?", "giraffe"),
        ("Which bird is a symbol of peace?", "dove"),
        ("Which animal has black and white stripes?", "zebra"),
        ("What do pandas mainly eat?", "bamboo"),
        ("Which animal gives us wool?", "sheep"),
        ("Which animal says moo?", "cow"),
        ("What is the largest bird in the world?", "ostrich"),
        ("Which animal is known as the ship of the desert?", "camel"),
        ("What is the only mammal that can truly fly?", "bat"),
        ("Which fish swims upstream to lay its eggs?", "salmon"),
        ("What do spiders spin?", "web"),
        ("What do you call molten rock that flows out of a volcano?", "lava"),
        ("What is the largest continent?", "Asia"),
        ("What is the smallest continent?", "Australia"),
        ("What is the largest country by area?", "Russia"),
        ("What is the longest river in South America?", "Amazon"),
        ("Which ocean lies between Europe and North America?", "Atlantic"),
        ("Which ocean lies between Africa and Australia?", "Indian"),
        ("What is the largest lake in Africa?", "Victoria"),
        ("In which city is the Eiffel Tower?", "Paris"),
        ("In which city is the Colosseum?", "Rome"),
        ("In which country is the Taj Mahal?", "India"),
        ("In which city is the Statue of Liberty?", "New York"),
        ("In which city is Big Ben?", "London"),
        ("In which country is Machu Picchu?", "Peru"),
        ("In which country is the Great Barrier Reef?", "Australia"),
        ("Which country is shaped like a boot?", "Italy"),
        ("Which country has a maple leaf on its flag?", "Canada"),
        ("What is the largest city in the United States?", "New York"),
        ("Who wrote Hamlet?", "Shakespeare"),
        ("Who wrote Pride and Prejudice?", "Austen"),
        ("Who wrote the Odyssey?", "Homer"),
        ("Who wrote War and Peace?", "Tolstoy"),
        ("Who wrote the Harry Potter books?", "Rowling"),
        ("Who wrote Don Quixote?", "Cervantes"),
        ("Who wrote A Christmas Carol?", "Dickens"),
        ("Who wrote the novel 1984?", "Orwell"),
        ("Who wrote On the Origin of Species?", "Darwin"),
        ("Who painted The Starry Night?", "Gogh"),
        ("Who painted the ceiling of the Sistine Chapel?", "Michelangelo"),
        ("Who composed the Moonlight Sonata?", "Beethoven"),
        ("Who composed The Magic Flute?", "Mozart"),
        ("Who invented the telephone?", "Bell"),
        ("Who invented the light bulb?", "Edison"),
        ("Who discovered penicillin?", "Fleming"),
        ("Who formulated the laws of motion and universal gravitation?", "Newton"),
        ("Who was the first person to walk on the Moon?", "Armstrong"),
        ("Who was the first human in space?", "Gagarin"),
        ("Who said that the Earth goes around the Sun?", "Copernicus|Galileo"),
        ("Who was the first female prime minister of the United Kingdom?", "Thatcher"),
        ("Who was the 16th president of the United States?", "Lincoln"),
        ("Who led India's independence movement through nonviolence?", "Gandhi"),
        ("Who co-founded Apple with Steve Wozniak?", "Jobs"),
        ("Who co-founded Microsoft with Paul Allen?", "Gates"),
        ("What is the opposite of big?", "small|little|tiny"),
        ("What is the opposite of happy?", "sad|unhappy"),
        ("What is the opposite of fast?", "slow"),
        ("What is the opposite of young?", "old"),
        ("What is the plural of child?", "children"),
        ("What is the plural of goose?", "geese"),
        ("What is the plural of tooth?", "teeth"),
        ("What is the past tense of go?", "went"),
        ("What is the past tense of eat?", "ate"),
        ("Translate 'thank you' into Spanish.", "gracias"),
        ("Translate 'goodbye' into French.", "revoir|adieu"),
        ("Translate 'cat' into Spanish.", "gato"),
        ("What language is spoken in Germany?", "German"),
        ("What language is spoken in Japan?", "Japanese"),
        ("What language is spoken in Italy?", "Italian"),
        ("What language is spoken in Argentina?", "Spanish"),
        ("What language is spoken in Egypt?", "Arabic"),
        ("What do you use to cut paper?", "scissors"),
        ("What do you call a doctor who treats animals?", "vet"),
        ("What do you call a person who flies a plane?", "pilot"),
        ("What do you call a doctor who treats teeth?", "dentist"),
        ("What is the first meal of the day called?", "breakfast"),
        ("What is bread mainly made from?", "flour|wheat"),
        ("What are French fries made from?", "potato"),
        ("Which fruit is wine made from?", "grape"),
        ("What is hummus made from?", "chickpea"),
        ("What is tofu made from?", "soy"),
        ("What drink do cows give?", "milk"),
        ("What color do you get when you mix blue and yellow?", "green"),
        ("What color do you get when you mix red and white?", "pink"),
        ("What color do you get when you mix red and blue?", "purple|violet"),
        ("What color is a ripe tomato?", "red"),
        ("What color is snow?", "white"),
        ("What color is coal?", "black"),
        ("What shape has three sides?", "triangle"),
        ("How many sides does an octagon have?", "eight|8"),
        ("How many degrees are in a right angle?", "90|ninety"),
        ("How many degrees are in a full circle?", "360"),
        ("How many years are in a century?", "100|hundred"),
        ("How many years are in a decade?", "ten|10"),
        ("Which sport is played at Wimbledon?", "tennis"),
        ("In which sport do players score touchdowns?", "football"),
        ("Which game has pieces called pawns, rooks and bishops?", "chess"),
        ("What day comes after Friday?", "Saturday"),
        ("What month comes after June?", "July"),
        ("What is the first month of the year?", "January"),
        ("What is the last month of the year?", "December"),
        ("What is the coldest season of the year?", "winter"),
        ("Which holiday is celebrated on December 25?", "Christmas"),
        ("What is a word that means the same as another word called?", "synonym"),
        ("What is a word that means the opposite of another word called?", "antonym"),
        ("Which fairy tale girl lost a glass slipper?", "Cinderella"),
        ("What is the name of the school Harry Potter attends?", "Hogwarts"),
        ("What is Superman's weakness?", "kryptonite"),
        ("What do you call a house made of snow blocks?", "igloo"),
        ("Which ship sank in 1912 after hitting an iceberg?", "Titanic"),
        ("In what year did World War II end?", "1945"),
        ("In what year did people first land on the Moon?", "1969"),
        ("In what year did Columbus first reach the Americas?", "1492"),
        ("In what year did World War I begin?", "1914"),
        ("Which ancient civilization built the pyramids of Giza?", "Egypt"),
        ("What does CPU stand for?", "central processing"),
        ("What does WWW stand for?", "world wide web"),
        ("What does USB stand for?", "universal serial bus"),
        ("Which company makes the iPhone?", "Apple"),
        ("Which programming language is named after a comedy group and shares its name with a snake?", "Python"),
        ("Which planet is closest to the Sun?", "Mercury"),
        ("What instrument measures temperature?", "thermometer"),
        ("What instrument measures air pressure?", "barometer"),
        ("What do you use to look at distant stars?", "telescope"),
        ("What do you use to look at tiny things like cells?", "microscope"),
        ("What do you call an animal that eats both plants and meat?", "omnivore"),
        ("What do you call an animal that eats only plants?", "herbivore"),
        ("What is a scientist who studies the weather called?", "meteorologist"),
        ("Which gas do plants give off during photosynthesis?", "oxygen"),
        ("What is the hardest substance in the human body?", "enamel"),
        ("What is the largest internal organ of the human body?", "liver"),
    ]
)


# The held-out knowledge check: kinds of question the recipe never trains (works and their makers, inventors,
# geography, dishes, animals, languages, currencies, sports, the human body, landmarks), none asked by
# `FACT_QUESTIONS` either. General training answers are the base model's own, so a tune that moves these scores has
# forgotten (or, rarely, surfaced) what the base model knew: it shows what a tune costs beyond the facts it was
# checked on. The kinds take turns, so any leading slice (the first 40, say) is a fair sample of them all.
KNOWLEDGE_QUESTIONS: tuple[FactQuestion, ...] = tuple(
    FactQuestion(q, tuple(k.split("|")))
    for q, k in [
        ("Who wrote The Hobbit?", "Tolkien"),
        ("Who invented the printing press?", "Gutenberg"),
        ("What is the largest country in South America?", "Brazil"),
        ("What is pesto mainly made from?", "basil"),
        ("What is a baby horse called?", "foal|colt|filly"),
        ("What language is spoken in the Netherlands?", "Dutch"),
        ("What is the currency of the United States?", "dollar"),
        ("How many players does a basketball team have on the court?", "five|5"),
        ("Which organ filters the blood to make urine?", "kidney"),
        ("In which Italian city is the Leaning Tower?", "Pisa"),
        ("Who wrote Alice's Adventures in Wonderland?", "Carroll"),
        ("Which brothers made the first powered airplane flight?", "Wright"),
        ("What is the largest island in the world?", "Greenland"),
        ("What is ketchup mainly made from?", "tomato"),
        ("What is a young frog called?", "tadpole|polliwog"),
        ("Which language do people speak in Russia?", "Russian"),
        ("What is the currency of India?", "rupee"),
        ("In which sport do players hit a shuttlecock?", "badminton"),
        ("How many lungs does a person have?", "two|2"),
        ("In which country is the Great Wall?", "China"),
        ("Who painted The Scream?", "Munch"),
        ("Who discovered radium?", "Curie"),
        ("What is the smallest country in the world?", "Vatican"),
        ("What vegetable are pickles usually made from?", "cucumber"),
        ("What is the largest cat in the world?", "tiger"),
        ("What is the main language of China?", "Chinese|Mandarin"),
        ("What currency is used in Spain?", "euro"),
        ("In which sport can you score a hole in one?", "golf"),
        ("What is the colored part of the eye called?", "iris"),
        ("In which city is the Golden Gate Bridge?", "San Francisco"),
        ("Who composed the Fifth Symphony?", "Beethoven"),
        ("Who invented the World Wide Web?", "Berners"),
        ("What is the highest mountain in Africa?", "Kilimanjaro"),
        ("What is chocolate made from?", "cocoa|cacao"),
        ("Which animal can change the color of its skin to match its surroundings?", "chameleon|octopus"),
        ("What language is spoken in Greece?", "Greek"),
        ("What is the currency of China?", "yuan|renminbi"),
        ("How many rings are on the Olympic flag?", "five|5"),
        ("Which bones protect the brain?", "skull|cranium"),
        ("In which country is Stonehenge?", "England|Britain|United Kingdom"),
        ("Who wrote The Adventures of Tom Sawyer?", "Twain"),
        ("Who invented dynamite?", "Nobel"),
        ("What is the coldest continent?", "Antarctica"),
        ("What is the main ingredient in an omelette?", "egg"),
        ("What do you call a male chicken?", "rooster|cockerel"),
        ("What is the official language of Portugal?", "Portuguese"),
        ("What is the currency of Russia?", "ruble|rouble"),
        ("Which sport is played on ice with a puck?", "hockey"),
        ("Which joint bends in the middle of the leg?", "knee"),
        ("In which city is the Sagrada Familia?", "Barcelona"),
        ("Who created the detective Sherlock Holmes?", "Doyle"),
        ("Which explorer led the first voyage around the world?", "Magellan"),
        ("Which river flows through London?", "Thames"),
        ("Which nut is marzipan made from?", "almond"),
        ("Which slow animal spends most of its life hanging upside down in trees?", "sloth"),
        ("What language do people speak in Sweden?", "Swedish"),
        ("What is the currency of Mexico?", "peso"),
        ("How often are the Summer Olympic Games held?", "four|4"),
        ("In which organ is food broken down after it is swallowed?", "stomach"),
        ("In which city is the Burj Khalifa?", "Dubai"),
        ("Who painted Guernica?", "Picasso"),
        ("Who invented the steam engine?", "Watt|Newcomen"),
        ("What is the largest state in the United States?", "Alaska"),
        ("What grain is risotto made from?", "rice"),
        ("What is the largest fish in the sea?", "whale shark"),
        ("What language is spoken in Iran?", "Persian|Farsi"),
        ("What is the currency of Canada?", "dollar"),
        ("In which sport do you knock down pins to score strikes and spares?", "bowling"),
        ("What sense do we use our nose for?", "smell"),
        ("In which country is Angkor Wat?", "Cambodia"),
        ("Who composed The Four Seasons?", "Vivaldi"),
        ("Who invented the radio?", "Marconi|Tesla"),
        ("In which mountain range is Mount Everest?", "Himalaya"),
        ("What is popcorn made from?", "corn|maize"),
        ("Which animal is a national symbol of Australia?", "kangaroo|emu|koala"),
        ("What is the official language of Austria?", "German"),
        ("What is the currency of Switzerland?", "franc"),
        ("How many players are on the field for one baseball team?", "nine|9"),
        ("What do red blood cells carry around the body?", "oxygen"),
        ("In which country is Mount Rushmore?", "United States|USA|America"),
    ]
)


# -------------------------------------------------------------------------------------------------- recall
_NAMES_TRAIN = [
    "Alice",
    "Bob",
    "Carlos",
    "Diana",
    "Ethan",
    "Fatima",
    "George",
    "Hannah",
    "Ivan",
    "Julia",
    "Kenji",
    "Laura",
    "Miguel",
    "Nadia",
    "Oscar",
    "Priya",
    "Quentin",
    "Rosa",
    "Samuel",
    "Tara",
    "Umar",
    "Valeria",
    "William",
    "Xenia",
    "Yusuf",
    "Zoe",
    "Amara",
    "Bruno",
    "Chloe",
    "Dmitri",
    "Elena",
    "Felix",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Leon",
    "Maya",
    "Nico",
]
_NAMES_HELD_OUT = [
    "Beatrice",
    "Cedric",
    "Dolores",
    "Emil",
    "Freya",
    "Gustavo",
    "Helga",
    "Idris",
    "Jasmine",
    "Klaus",
    "Lucia",
    "Matteo",
    "Noor",
    "Olivia",
    "Pablo",
    "Renata",
    "Stefan",
    "Thea",
    "Viktor",
    "Wanda",
]
_CITIES_TRAIN = [
    "Paris",
    "Berlin",
    "Madrid",
    "Rome",
    "Lisbon",
    "Toronto",
    "Chicago",
    "Boston",
    "Seattle",
    "Sydney",
    "Mumbai",
    "Cairo",
    "Nairobi",
    "Lima",
    "Oslo",
    "Dublin",
    "Vienna",
    "Prague",
    "Warsaw",
    "Athens",
]
_CITIES_HELD_OUT = [
    "Helsinki",
    "Montreal",
    "Denver",
    "Osaka",
    "Santiago",
    "Budapest",
    "Zurich",
    "Auckland",
    "Manila",
    "Istanbul",
]

_FACTS_TRAIN = [
    ("name", "My name is {x}.", "What is my name?", "Your name is {x}."),
    ("name", "Hi, I'm {x}.", "Do you remember my name?", "Yes, your name is {x}."),
    ("name", "Call me {x}, please.", "What did I ask you to call me?", "You asked me to call you {x}."),
    ("number", "My favorite number is {x}.", "What is my favorite number?", "Your favorite number is {x}."),
    ("number", "Please remember the number {x}.", "What number did I ask you to remember?", "The number was {x}."),
    ("number", "My locker code is {x}.", "What is my locker code?", "Your locker code is {x}."),
    ("city", "I live in {x}.", "Where do I live?", "You live in {x}."),
    ("city", "I was born in {x}.", "Which city was I born in?", "You were born in {x}."),
    ("name", "Hey there, {x} here.", "Who did I say I was?", "You said you are {x}."),
    ("name", "This is {x} speaking.", "Do you know who I am?", "Yes, you are {x}."),
    ("name", "My friends call me {x}.", "What's my name again?", "Your name is {x}."),
    ("number", "My lucky number is {x}.", "Which number is my lucky one?", "Your lucky number is {x}."),
    ("number", "The code for the door is {x}.", "What was the door code?", "The door code is {x}."),
    ("city", "I grew up in {x}.", "Where did I grow up?", "You grew up in {x}."),
    ("city", "Right now I'm staying in {x}.", "Which city am I in?", "You are in {x}."),
]
_FACTS_HELD_OUT = [
    ("name", "Hello! My name's {x}.", "Can you tell me my name?", ""),
    ("number", "Remember this number for me: {x}.", "Which number did I give you earlier?", ""),
    ("city", "I'm from {x}.", "Where am I from?", ""),
    ("name", "I am {x}, nice to meet you.", "Who am I?", ""),
]
_ACKS = {
    "name": ["Nice to meet you, {x}! How can I help you today?", "Hello {x}! What can I do for you?"],
    "number": ["Got it, I'll remember {x}.", "Okay, {x} it is. How can I help?"],
    "city": ["{x} is a wonderful place! How can I help you today?", "That's great! What would you like to talk about?"],
}


def _fact_value(rng: random.Random, kind: str, held_out: bool) -> str:
    if kind == "name":
        return rng.choice(_NAMES_HELD_OUT if held_out else _NAMES_TRAIN)
    if kind == "city":
        return rng.choice(_CITIES_HELD_OUT if held_out else _CITIES_TRAIN)
    return str(rng.randint(10, 9999) if held_out else rng.choice([rng.randint(1, 99), rng.randint(100, 99999)]))


def recall_conversations(
    rng: random.Random, count: int, middles: list[tuple[str, Any]], held_out: bool
) -> list[tuple[RecallConversation, list[Message]]]:
    """`count` recall conversations: a fact, one unrelated exchange (two in a third of the training ones), the
    recall question. `middles` are (question, assistant content) pairs for the middle turns (general answers and
    tool calls); in held-out conversations the last assistant turn is left for the model."""
    facts = _FACTS_HELD_OUT if held_out else _FACTS_TRAIN
    out = []
    for _ in range(count):
        kind, fact, recall, answer = rng.choice(facts)
        value = _fact_value(rng, kind, held_out)
        middle_question, middle_answer = rng.choice(middles)
        item = RecallConversation(fact.format(x=value), middle_question, recall, value)
        messages: list[Message] = [
            {"role": "user", "content": item.fact},
            {"role": "assistant", "content": rng.choice(_ACKS[kind]).format(x=value)},
            {"role": "user", "content": middle_question},
            {"role": "assistant", "content": middle_answer},
        ]
        if not held_out and rng.random() < 1 / 3:
            question, content = rng.choice(middles)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": content}]
        messages.append({"role": "user", "content": recall})
        if not held_out:
            messages.append({"role": "assistant", "content": answer.format(x=value)})
        out.append((item, messages))
    return out


def route_dialogues(count: int, seed: int, tools: bool) -> list[list[str]]:
    """What `chatapp route` has a model answer, as each conversation's user turns: general prompts, a third tool
    questions when the model has a tool (training phrasings: the held-out ones stay unseen for the evaluation), a
    sixth chains of tool questions (`chained_conversations`' shapes: a letter count after arithmetic is where a
    routed or tuned model repeats the earlier call), and a quarter recall conversations (a fact, an unrelated
    question, the question that recalls the fact), so that the fit sees answers that read back across turns."""
    rng = random.Random(seed)
    recall_count = count // 4
    chain_count = count // 6 if tools else 0
    tool_count = (count - recall_count - chain_count) // 3 if tools else 0
    general = general_prompts(rng, count - tool_count - chain_count)
    tool = [q.question for q, _ in tool_questions(rng, tool_count, held_out=False, kinds=TRAIN_KINDS)]
    singles = general[: count - tool_count - chain_count - recall_count] + tool
    middles = general[count - tool_count - chain_count - recall_count :]
    dialogues = [[prompt] for prompt in singles]
    for middle in middles:
        kind, fact, recall, _ = rng.choice(_FACTS_TRAIN)
        dialogues.append([fact.format(x=_fact_value(rng, kind, held_out=False)), middle, recall])
    if chain_count:
        exchanges = [tool_conversation(q, a) for q, a in tool_questions(rng, 2 * chain_count, False, TRAIN_KINDS)]
        asked = [[{"role": "user", "content": p}] for p in general[: chain_count // 2]]
        for chain in chained_conversations(rng, chain_count, exchanges, asked):
            dialogues.append([m["content"] for m in chain if m["role"] == "user"])
    rng.shuffle(dialogues)
    return dialogues
