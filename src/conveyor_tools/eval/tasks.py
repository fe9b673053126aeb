"""A small evaluation task set written for Conveyor: 100 chat items of four kinds, each with the
answer and how it is judged.

It is not a benchmark of the model (SmolLM2-135M gets many wrong); it is a check that a
real model answers through Conveyor as it does through transformers, item by item, on
questions whose answers a reader can judge at a glance: ``arithmetic`` (30: sums, differences,
products of small numbers), ``capitals`` (30), ``completions`` (20: one missing word) and
``format`` (20: instructions about the form of the reply). ``number`` items (arithmetic) are
right when the reply's last number is the answer (a reply repeating the question holds its
operands); ``contains`` items when the reply holds the answer as a word (any case); ``exact``
items when the reply, stripped of spaces and a final period or exclamation mark, is exactly
the answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    id: str
    category: str
    question: str
    answer: str
    match: str  # "number", "contains" or "exact"

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.question}]

    def correct(self, reply: str) -> bool:
        if self.match == "exact":
            return reply.strip().rstrip(".!").strip() == self.answer
        if self.match == "number":
            numbers = re.findall(r"-?\d+(?:\.\d+)?", reply.replace(",", ""))
            return bool(numbers) and float(numbers[-1]) == float(self.answer)
        return re.search(rf"(?<!\w){re.escape(self.answer)}(?!\w)", reply, flags=re.IGNORECASE) is not None


_ARITHMETIC = [
    (2, "+", 3),
    (7, "+", 5),
    (9, "+", 8),
    (12, "+", 30),
    (25, "+", 25),
    (14, "+", 9),
    (40, "+", 60),
    (33, "+", 11),
    (8, "+", 6),
    (100, "+", 23),
    (10, "-", 4),
    (15, "-", 7),
    (20, "-", 9),
    (50, "-", 25),
    (9, "-", 3),
    (30, "-", 12),
    (100, "-", 1),
    (18, "-", 9),
    (3, "*", 4),
    (6, "*", 7),
    (5, "*", 5),
    (9, "*", 9),
    (2, "*", 8),
    (10, "*", 10),
    (7, "*", 3),
    (4, "*", 6),
    (11, "*", 2),
    (12, "*", 3),
    (8, "*", 8),
    (1, "*", 42),
]
_WORDS = {"+": "plus", "-": "minus", "*": "times"}
_CAPITALS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Germany", "Berlin"),
    ("Spain", "Madrid"),
    ("Egypt", "Cairo"),
    ("Russia", "Moscow"),
    ("China", "Beijing"),
    ("Canada", "Ottawa"),
    ("Australia", "Canberra"),
    ("Greece", "Athens"),
    ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Poland", "Warsaw"),
    ("Austria", "Vienna"),
    ("Hungary", "Budapest"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Argentina", "Buenos Aires"),
    ("Thailand", "Bangkok"),
    ("South Korea", "Seoul"),
    ("the United Kingdom", "London"),
    ("Denmark", "Copenhagen"),
    ("Belgium", "Brussels"),
    ("Turkey", "Ankara"),
    ("India", "New Delhi"),
    ("Mexico", "Mexico City"),
]
_COMPLETIONS = [
    ("The opposite of hot is", "cold"),
    ("The opposite of up is", "down"),
    ("The color of the clear daytime sky is", "blue"),
    ("Cows drink water and produce", "milk"),
    ("The day after Monday is", "Tuesday"),
    ("The month after January is", "February"),
    ("Ice is frozen", "water"),
    ("The planet we live on is called", "Earth"),
    ("A baby cat is called a", "kitten"),
    ("The star at the center of our solar system is the", "Sun"),
    ("Bees make", "honey"),
    ("The opposite of day is", "night"),
    ("We see with our", "eyes"),
    ("A week has seven", "days"),
    ("The color of grass is", "green"),
    ("Water boils at one hundred degrees", "Celsius"),
    ("The largest ocean on Earth is the", "Pacific"),
    ("The season after winter is", "spring"),
    ("A triangle has three", "sides"),
    ("The opposite of yes is", "no"),
]
_FORMAT = [
    ("Reply with only the word YES in capital letters.", "YES"),
    ("Reply with only the word no in lowercase letters.", "no"),
    ("Write the number seven as a digit and nothing else.", "7"),
    ("Write the number twelve as digits and nothing else.", "12"),
    ("Reply with only the word blue.", "blue"),
    ("Answer with one word: what color is snow?", "White"),
    ("Reply with only the letter A.", "A"),
    ("Repeat exactly: hello world", "hello world"),
    ("Repeat exactly: good morning", "good morning"),
    ("Repeat exactly: Conveyor", "Conveyor"),
    ("Reply with only the word OK.", "OK"),
    ("What is 2 + 2? Reply with only the digit.", "4"),
    ("What is 5 + 4? Reply with only the digit.", "9"),
    ("Spell the word cat in capital letters, nothing else.", "CAT"),
    ("Reply with only the first letter of the alphabet, lowercase.", "a"),
    ("Reply with only the number that comes after 9.", "10"),
    ("Reply with only the word true.", "true"),
    ("Reply with only the word false.", "false"),
    ("Write only the word Paris.", "Paris"),
    ("Reply with only the word stop.", "stop"),
]


def tasks() -> list[Item]:
    """The 100 items, in a fixed order (ids ``arithmetic-00`` ... ``format-19``)."""
    items = []
    for i, (a, op, b) in enumerate(_ARITHMETIC):
        value = a + b if op == "+" else a - b if op == "-" else a * b
        question = f"What is {a} {_WORDS[op]} {b}? Answer with just the number."
        items.append(Item(f"arithmetic-{i:02d}", "arithmetic", question, str(value), "number"))
    for i, (country, capital) in enumerate(_CAPITALS):
        items.append(Item(f"capitals-{i:02d}", "capitals", f"What is the capital of {country}?", capital, "contains"))
    for i, (start, word) in enumerate(_COMPLETIONS):
        question = f"Complete the sentence with one word: {start} ..."
        items.append(Item(f"completions-{i:02d}", "completions", question, word, "contains"))
    for i, (question, answer) in enumerate(_FORMAT):
        items.append(Item(f"format-{i:02d}", "format", question, answer, "exact"))
    return items
