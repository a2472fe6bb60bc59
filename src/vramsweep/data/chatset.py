"""The shipped chat set (``data=grant_chat``): questions about the synthetic grant reports, answered from
them.

Deterministic like the documents it is built from (:func:`vramsweep.data.synthetic.generate_documents` with
the same seed): each conversation is a system prompt, a first user turn that shares the report's sections
stating :data:`QUESTIONS_PER_CHAT` of its key facts and asks about the first, and one short exchange per
further fact. Every answer states the fact's value verbatim, so the value is a fact span of a trained
(assistant) turn and ``task_score`` measures whether the model copies it from the report.
"""

from __future__ import annotations

import random
from typing import Any

from vramsweep.data.documents import format_section
from vramsweep.data.synthetic import generate_documents

__all__ = ["QUESTIONS", "QUESTIONS_PER_CHAT", "SYSTEM", "chat_records", "generate_chats"]

SYSTEM = "You answer questions about the grant report the user shares, using only what the report says."
QUESTIONS_PER_CHAT = 3
#: fact key -> (question, answer with ``{v}`` for the value)
QUESTIONS: dict[str, tuple[str, str]] = {
    "acronym": ("What is the project's acronym?", "The project's acronym is {v}."),
    "coordinator": ("Who coordinates the project?", "The project is coordinated by {v}."),
    "partner_count": ("How many partners are in the consortium?", "The consortium has {v} partners."),
    "num_work_packages": ("How many work packages does the project have?", "It has {v} work packages."),
    "budget_total": ("What is the total budget in euros?", "The total budget is {v} euros."),
    "start_date": ("When does the project start?", "The project starts on {v}."),
}


def chat_records(docs: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """One ``messages`` record per document (module docstring), with its ``facts`` (the answered values)."""
    rng = random.Random(seed)
    out = []
    for doc in docs:
        facts = [f for f in doc["facts"] if f["key"] in QUESTIONS]
        picked = sorted(rng.sample(facts, min(QUESTIONS_PER_CHAT, len(facts))), key=lambda f: f["stated_in"])
        shown = sorted({f["stated_in"] for f in picked})
        report = "".join(format_section(doc["sections"][i]) for i in shown).strip()
        msgs = [{"role": "system", "content": SYSTEM}]
        for j, f in enumerate(picked):
            q, a = QUESTIONS[f["key"]]
            user = f"Here is a grant report.\n\n{report}\n\n{q}" if j == 0 else q
            msgs += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": a.format(v=f["value"])},
            ]
        out.append({"id": f"{doc['id']}-chat", "messages": msgs, "facts": [f["value"] for f in picked]})
    return out


def generate_chats(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` chat records built from ``generate_documents(n, seed)``."""
    return chat_records(generate_documents(n, seed), seed)
