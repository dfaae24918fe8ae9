#!/usr/bin/env python3
"""Writes fixtures/prompt-set.jsonl: a few hundred varied conversations for `kvdiff sweep`.

Deterministic (fixed seed). Each line is {"id": ..., "messages": [...]} in the OpenAI chat shape.
The set mixes: a system prompt or none; one to four earlier turns; languages and scripts
(accents, Cyrillic, CJK, emoji: multi-byte characters that byte-level tokens split); very short
turns ("ok.") and long ones; a turn repeated verbatim (chunk-store hits); and messages given as
a list of strings (chunk boundaries inside a message).

    python3 scripts/make_prompt_set.py [OUT] [COUNT]
"""
import json
import random
import sys

SYSTEMS = [
    "Always answer in uppercase.",
    "You are a terse assistant. Answer in one word.",
    "Answer in the language of the question.",
    "Réponds toujours en français, s'il te plaît.",
    "You only repeat facts from the conversation.",
]
FACTS = [
    ("Anna", "color", "blue"), ("Ben", "city", "oslo"), ("Carla", "pet", "cat"), ("Dmitri", "number", "seven"),
    ("Eva", "food", "rice"), ("Farid", "sport", "chess"), ("Gül", "city", "izmir"), ("Hiro", "color", "green"),
]
PHRASES = [
    "ok.", "?", "yes", "Thanks!", "Danke schön, das ist groß.", "¿Dónde está la estación?",
    "Спасибо, это интересно.", "今日はいい天気ですね。", "我喜欢学习新的东西。", "🙂👍 sounds good",
    "Ça coûte combien ? Très cher, hélas.", "naïve café — déjà vu",
]
LONG = ("Here is some background that the model should keep in mind while answering. "
        "It goes on for a while, mentioning several unrelated details: the weather was mild, "
        "the train was late, and the meeting moved to Thursday afternoon. ")


def fact_turn(rng):
    name, attr, value = rng.choice(FACTS)
    return f"Remember this. {name}'s {attr} is {value}.", f"What is {name}'s {attr}?"


def conversation(rng, i):
    msgs = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    fact, question = fact_turn(rng)
    turns = rng.randint(0, 4)
    repeated = rng.choice(PHRASES) if rng.random() < 0.3 else None
    for t in range(turns):
        kind = rng.random()
        if kind < 0.3:
            user = fact
        elif kind < 0.5:
            user = LONG * rng.randint(1, 2)
        else:
            user = rng.choice(PHRASES)
        if repeated and t % 2 == 0:
            user = repeated
        if rng.random() < 0.2:
            # A message given as chunks: a boundary inside the message.
            msgs.append({"role": "user", "content": [user, " " + rng.choice(PHRASES)]})
        else:
            msgs.append({"role": "user", "content": user})
        msgs.append({"role": "assistant", "content": rng.choice(["OK.", "Noted.", "Gut.", "好的。", "ok."])})
    if turns == 0 or rng.random() < 0.5:
        question = f"{fact} {question}"
    msgs.append({"role": "user", "content": question if rng.random() < 0.9 else rng.choice(PHRASES)})
    return {"id": f"conv-{i:04d}", "messages": msgs}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "fixtures/prompt-set.jsonl"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    rng = random.Random(20261123)
    with open(out, "w", encoding="utf-8") as f:
        for i in range(count):
            f.write(json.dumps(conversation(rng, i), ensure_ascii=False) + "\n")
    print(f"wrote {count} conversations to {out}")


if __name__ == "__main__":
    main()
