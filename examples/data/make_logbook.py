"""Writes the demo's fine-tuning corpus: a lighthouse keeper's logbook, a style and domain
unlike tiny_corpus.txt (the pre-training text). Deterministic: the same files every run.

    python examples/data/make_logbook.py
"""

import random
from pathlib import Path

WIND = ["north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west"]
SKY = ["clear", "overcast", "low cloud", "fog on the water", "rain squalls", "a haze to seaward"]
SEA = ["calm", "slight", "moderate", "rough", "a long swell from the west"]
VESSELS = ["the fishing boat Marigold", "a coal steamer", "the mail packet", "two trawlers",
           "a three-masted schooner", "the pilot cutter", "an oil tanker", "the ferry from the island"]
TASKS = ["trimmed the wicks", "polished the lens", "wound the clockwork", "painted the gallery rail",
         "carried oil up the tower", "mended the fog bell rope", "cleaned the lantern glass",
         "checked the barometer twice"]
EVENTS = ["Gulls nesting on the north ledge.", "Supply boat delayed by weather.",
          "Keeper's relief arrived at noon.", "Heard the fog signal from the point.",
          "Seals hauled out on the reef at low water.", "Lamp lit at sunset, extinguished at dawn.",
          "Inspector's visit; all in order.", "Glass falling steadily since midday."]


def entry(rng: random.Random, day: int) -> str:
    hour = rng.randint(0, 23)
    lines = [
        f"Day {day}. {hour:02d}00 hours. Wind {rng.choice(WIND)}, force {rng.randint(1, 9)}.",
        f"Sky {rng.choice(SKY)}; sea {rng.choice(SEA)}. Visibility {rng.randint(1, 12)} miles.",
        f"Sighted {rng.choice(VESSELS)} bearing {rng.choice(WIND)}, all well.",
        f"Keeper {rng.choice(TASKS)} and {rng.choice(TASKS)}.",
        rng.choice(EVENTS),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    rng = random.Random(7)
    here = Path(__file__).parent
    entries = [entry(rng, d) for d in range(1, 361)]
    (here / "logbook_train.txt").write_text("\n".join(entries[:320]))
    (here / "logbook_valid.txt").write_text("\n".join(entries[320:]))


if __name__ == "__main__":
    main()
