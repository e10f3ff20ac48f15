"""Workloads of real text through the model's chat template, where what the model writes matters:

- copy: the model repeats, or lightly edits, a passage it was given (what speculative decoding's prompt
  lookup is for: most of the output is in the prompt);
- chat: open questions, answered freely (little of the output is in the prompt).

The prompts are token ids, the same for every server; outputs end at the model's end of turn or at the
request's max_tokens.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from services.bench.workloads import BenchRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PASSAGES = [
    "Mara opened the bakery at five every morning. She lit the ovens, weighed the flour and set the first "
    "loaves to rise while the street outside was still dark. By seven the queue reached the corner, and by "
    "noon the shelves were empty except for a few rye rolls that nobody wanted.",
    "The river rose slowly through the night. By dawn it had covered the lower field, and the farmer moved "
    "his sheep to the hill behind the barn. Tomas watched the brown water from the kitchen window and "
    "counted the fence posts that still showed above it.",
    "To reset the router, unplug it, wait thirty seconds, and plug it back in. When the light turns green, "
    "open the settings page in a browser, sign in with the password printed on the label, and choose a new "
    "name for the network. Save the changes and wait for the router to restart.",
    "Elena packed two sandwiches, a map and a flask of tea before she set off up the mountain path. The "
    "morning was clear, but by the second hour clouds had gathered over the ridge, and she decided to turn "
    "back at the old stone shelter rather than risk the last steep climb in the fog.",
    "The museum's new wing holds three rooms of maps, the oldest drawn on calfskin more than six hundred "
    "years ago. Visitors enter through a hall of globes, pass a long table of sea charts, and end in a "
    "small dark room where a single map of the city is lit from below.",
    "Jonas fixed bicycles in a shed behind his house. He kept every part in a labelled drawer, from brake "
    "pads to tiny springs, and he could find any of them with his eyes closed. Children from the whole "
    "village brought him their punctures, and he never charged them more than a coin.",
    "Water the tomatoes in the evening, not at midday, so that less of the water is lost to the sun. Pinch "
    "out the side shoots every week, tie the main stem to its cane as it grows, and pick the fruit as soon "
    "as it turns red, before the birds find it.",
    "The train left the station twelve minutes late. Priya found a seat by the window, opened her book, and "
    "read the same page three times while the suburbs gave way to fields. At the second stop an old man "
    "sat down opposite her and began, without any introduction, to talk about his garden.",
]
INSTRUCTIONS = [
    "Repeat the following passage exactly, word for word:\n\n{passage}",
    "Copy the following text exactly as it is, changing nothing:\n\n{passage}",
    "Rewrite the following passage with each sentence on its own line:\n\n{passage}",
]
QUESTIONS = [
    "Why is the sky blue?",
    "Give me three ideas for a rainy weekend.",
    "How do I make a good cup of tea?",
    "What is the difference between weather and climate?",
    "Write a short poem about autumn.",
    "Explain what a prime number is to a child.",
    "What should I pack for a week at the beach?",
    "How does a bicycle stay upright?",
    "Suggest a name for a friendly robot and explain why.",
    "What are some tips for learning a new language?",
    "Describe a perfect Sunday morning.",
    "Why do cats purr?",
    "How can I save energy at home?",
    "Tell me a short story about a lost key.",
    "What makes a good friend?",
    "How do plants grow from seeds?",
]


def text_requests(
    name: str, count: int, tokenizer: PreTrainedTokenizerBase, output_len: tuple[int, int], seed: int = 0
) -> list[BenchRequest]:
    """count requests of the copy or chat workload, all arriving at once (a concurrency drives them)."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        if name == "copy":
            content = rng.choice(INSTRUCTIONS).format(passage=rng.choice(PASSAGES))
        else:
            content = rng.choice(QUESTIONS)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        requests.append(BenchRequest(index, prompt_ids, rng.randint(*output_len), False, 0.0))
    return requests
