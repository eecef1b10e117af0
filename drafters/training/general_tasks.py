"""General instructions (explain, summarize, compare, write an email or a plan) over the topic lists
of `topics.json`: the everyday requests a chat model answers besides code and math."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from drafters.training.prompt_pool import pick_prompts, seeded_order

TOPICS_FILE = Path(__file__).with_name("topics.json")

CONCEPT_TEMPLATES = (
    "Explain {topic} to someone with no background in {category}.",
    "What is {topic}? Give a clear explanation and one concrete example.",
    "Summarize the key ideas of {topic} in a few bullet points.",
    "What are common misconceptions about {topic}, and what is actually true?",
    "Write a short study guide on {topic}: key terms, the main ideas and three review questions.",
    "Explain {topic} in depth, as you would to a university student.",
    "Write five quiz questions about {topic}, each followed by its answer.",
    "Why does {topic} matter? Describe where it shows up in practice.",
    "Explain {topic} with an analogy from everyday life, then say where the analogy breaks down.",
    "Write a short blog post that introduces {topic} to curious readers.",
    "Give a brief overview of how our understanding of {topic} developed.",
    "I have to give a five-minute talk on {topic}. Write an outline with the points to cover.",
)
PAIR_TEMPLATES = (
    "Compare {a} and {b}: how are they similar and how do they differ?",
    "What is the difference between {a} and {b}? Keep it short and precise.",
)
EMAIL_TEMPLATES = (
    "Write a polite, concise email {situation}.",
    "Draft a short, friendly message {situation}.",
    "Write a formal letter {situation}, and explain the choices of tone you made.",
)
PLAN_TEMPLATES = (
    "Make a step-by-step plan to {goal}.",
    "Create a four-week schedule to {goal}, with a goal for each week.",
    "What are the first steps to {goal}, and which mistakes should I avoid?",
    "I want to {goal}. Ask me the three questions that matter most, then suggest a plan.",
)


@cache
def topics() -> dict:
    return json.loads(TOPICS_FILE.read_text())


def general_prompts(count: int | None, seed: int) -> list[str]:
    """Up to `count` (None: all) distinct general instructions, a pure function of (count, seed)."""
    data = topics()
    concepts = [(topic, category) for category, names in sorted(data["concepts"].items()) for topic in names]
    pairs = [(a, b) for names in data["concepts"].values() for a, b in zip(names, names[1:])]
    groups = []
    for i, template in enumerate(CONCEPT_TEMPLATES):
        groups.append([template.format(topic=t, category=c) for t, c in seeded_order(concepts, seed, f"concept{i}")])
    for i, template in enumerate(PAIR_TEMPLATES):
        groups.append([template.format(a=a, b=b) for a, b in seeded_order(pairs, seed, f"pair{i}")])
    for i, template in enumerate(EMAIL_TEMPLATES):
        groups.append([template.format(situation=s) for s in seeded_order(data["emails"], seed, f"email{i}")])
    for i, template in enumerate(PLAN_TEMPLATES):
        groups.append([template.format(goal=g) for g in seeded_order(data["plans"], seed, f"plan{i}")])
    return pick_prompts(groups, count)
