"""The synthetic chat task the default model is trained on.

A conversation is: an optional system prompt fixing the answer's letter case, one or two context
turns stating facts ("Anna's color is blue."), each acknowledged by the assistant, then a question
about one of the facts. The right answer depends on the system prompt (case) and on the context
(the fact), so a path that loses either answers visibly wrong.
"""

import random

NAMES = [
    "Anna", "Ben", "Carla", "David", "Emma", "Felix", "Grace", "Hugo", "Ivy", "Jonas",
    "Kira", "Leo", "Mia", "Noah", "Olga", "Paul", "Rosa", "Sam", "Tara", "Umar",
]
ATTRIBUTES = {
    "color": ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"],
    "city": ["paris", "tokyo", "lima", "oslo", "cairo", "delhi", "rome", "quito"],
    "pet": ["cat", "dog", "horse", "parrot", "rabbit", "turtle", "goat", "fish"],
}
SYSTEM = {
    "upper": ["Always answer in uppercase.", "Reply using only capital letters.",
              "You answer in UPPERCASE letters."],
    "lower": ["Always answer in lowercase.", "Reply using only small letters.",
              "You answer in lowercase letters."],
}
CONTEXT_LEADS = ["Remember this.", "Some facts:", "Note the following.", "Here is what I know."]
QUESTIONS = ["What is {name}'s {attr}?", "Tell me {name}'s {attr}.", "Which {attr} does {name} have?"]


def apply_case(text, case):
    if case == "upper":
        return text.upper()
    if case == "lower":
        return text.lower()
    return text


def make_example(rng: random.Random):
    """Returns (messages, expected_answer, case, value)."""
    case = rng.choice(["upper", "lower", "upper", "lower", "plain"])
    names = rng.sample(NAMES, rng.randint(2, 4))
    facts = []
    for name in names:
        attr = rng.choice(list(ATTRIBUTES))
        facts.append((name, attr, rng.choice(ATTRIBUTES[attr])))
    messages = []
    if case != "plain":
        messages.append({"role": "system", "content": rng.choice(SYSTEM[case])})
    split = rng.randint(1, len(facts) - 1) if rng.random() < 0.4 else len(facts)
    for part in (facts[:split], facts[split:]):
        if not part:
            continue
        body = " ".join(f"{n}'s {a} is {v}." for n, a, v in part)
        messages.append({"role": "user", "content": f"{rng.choice(CONTEXT_LEADS)} {body}"})
        messages.append({"role": "assistant", "content": apply_case("Ok.", case)})
    name, attr, value = rng.choice(facts)
    messages.append({"role": "user", "content": rng.choice(QUESTIONS).format(name=name, attr=attr)})
    answer = apply_case(f"{name}'s {attr} is {value}.", case)
    return messages, answer, case, value


def corpus_lines(rng: random.Random, n: int):
    """Plain text for training the BPE: task text plus generic text so any prompt tokenizes sanely."""
    generic = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello, world! How are you today?",
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026.",
        "Please summarise the document below and answer the question.",
        "你好，世界。今天天气很好。",
        "Bonjour le monde. Wie geht es dir?",
        "<think>\nLet me think step by step.\n</think>\n\n",
        "def main():\n    print('hi')\n",
        "system\nuser\nassistant\n",
        "The system prompt, the user and the assistant take turns.\n\n",
    ]
    for _ in range(n):
        messages, answer, _, _ = make_example(rng)
        for m in messages:
            yield m["content"]
        yield answer
    for _ in range(50):
        yield from generic
