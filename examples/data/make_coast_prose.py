"""Writes coast_prose.txt: plain narrative prose about a lighthouse coast, pre-training text
for the demo's base models. Deterministic: the same file every run.

    python examples/data/make_coast_prose.py

It uses the logbook's vocabulary (``make_logbook.py``'s lists of winds, skies, seas, vessels
and keeper's tasks, its capitalised words, and numbers of days, hours, forces and miles)
but not its style: sentences of a story, not the logbook's five terse lines an entry. A base
pre-trained on it knows the logbook's tokens, so fine-tuning (LoRA above all, which keeps the
embeddings and the output head frozen) has the logbook's style to learn, not its words.
The fine-tuning text itself (logbook_train.txt, logbook_valid.txt) is never copied here.
"""

import random
from pathlib import Path

from make_logbook import SKY, TASKS, VESSELS, WIND

SEA = ["calm", "slight", "moderate", "rough"]  # the logbook's sea states that read as adjectives
SKY_ADJ = SKY[:2]  # "clear", "overcast"; the rest read as nouns ("low cloud", "rain squalls", ...)
SKY_NOUN = SKY[2:]
NAMES = ["Morgan", "Tregarthen", "Ellis", "Pascoe", "Quiller"]

# Each sentence is a template of the prose; {slots} are filled from the lists above.
SENTENCES = [
    "The wind had gone round to the {wind} before dawn, and by {hour} hours the sea was {sea}.",
    "Keeper {name} {task} while the kettle boiled, then {task2} before the light was needed.",
    "Nobody on the island could remember a summer with so much fog on the water.",
    "From the gallery you could see {vessel} working slowly {wind}ward against the tide.",
    "Sighted at last after {n} days of waiting, {vessel} came round the point with the sky {sky_adj} behind her.",
    "Wind and weather decided everything on the rock, and the keepers had learned not to argue with either.",
    "Sky and sea were the same grey colour that morning, so that {vessel} seemed to hang in the air.",
    "Visibility was never good in that season; on most days it was {n} miles at best, and often less.",
    "Day {day} of his posting began like the others: the lamp put out at dawn, the log written up, the lens wiped.",
    "On day {day} the glass began to fall steadily, and by midday the sea was {sea} and the wind {wind}.",
    "The old men in the harbour said a {wind} wind of force {force} would bring {sky} by evening.",
    "It was {hour} hours when the relief boat finally reached the landing, {n} hours later than promised.",
    "The gulls were nesting again on the north ledge, and the seals hauled out on the reef at low water.",
    "Keeper {name} liked the night watch best, when the only sounds were the clockwork and the sea.",
    "Supply boats were often delayed by weather, so the store room held oil and flour for {n} weeks.",
    "The inspector came on day {day}, walked round the tower twice, and found all in order.",
    "When the fog signal from the point began, the whole family knew the ferry from the island would be late.",
    "Bearing {wind} of the tower lay the reef, and every keeper learned its bearing before anything else.",
    "All well, he wrote, though the wind had been force {force} since the morning and the sea was {sea}.",
    "A lamp lit at sunset and put out at dawn was the whole of the job, and also the whole of its danger.",
    "They had {sky} all afternoon, and the keepers took turns to watch for {vessel}.",
    "In fine weather the view ran {n} miles to the mainland; in a haze to seaward it ran to nothing at all.",
    "Keeper {name} {task}, {task2}, and still found time to read by the window until {hour} hours.",
    "The children of the island were told that {vessel} once anchored in the bay for {n} days.",
    "Sighted from the cliff path, the tower looked small, and the sea around it was {sea} even in summer.",
    "Visibility dropped to {n} miles as the rain squalls came over, and the lamp was lit early.",
    "Wind {wind}, said the barometer's owner, as if the word itself could keep the boats at home.",
    "Force {force} was nothing to the keepers; they spoke of force nine the way others speak of the king.",
    "The mail packet brought letters, tobacco and news, and left again on the {wind}erly tide.",
    "Every evening somebody {task}, and every morning somebody {task2}; the routine never changed.",
    "A long swell from the west made the landing dangerous, so the crates were hauled up by rope.",
    "During the long winter the keepers counted the days: day {day}, day {day2}, and the spring still far off.",
    "Sky {sky_adj} and wind {wind} were the words he used most often, though he was not a man of few words.",
    "The two trawlers passed so close that the crews waved, and Keeper {name} waved back from the gallery rail.",
    "At {hour} hours the glass was still falling, and the wind had reached force {force} from the {wind}.",
    "Keepers came and went, but the lens, the wicks and the clockwork stayed the same for {n} years.",
    "The pilot cutter came out to meet {vessel} a few miles off, in a sea that was {sea} and getting worse.",
    "Fog on the water hid the reef for {n} hours, and the fog bell rang until the rope wore through.",
    "He remembered the coal steamer best, low in the water, smoking, bound {wind} in the rain.",
    "Low cloud sat on the hills behind the harbour for {n} days, and nobody saw the sun.",
    "Gulls followed the fishing boat Marigold all the way in, screaming over the catch.",
    "Seals lay on the reef at low water and watched the tower with round dark eyes.",
    "Lamp oil went up the tower in cans, {n} cans a night in the depth of winter.",
    "Supply boats came when the weather allowed, which in a {wind} gale was never.",
    "Heard from the gallery, the fog signal from the point sounded like a lost cow.",
    "Inspector's visits were dreaded more than storms, and the brass was polished for days before.",
    "Glass falling, the old keeper would say at {hour} hours, and go round to check the shutters.",
    "Keeper's relief was the happiest phrase in the language, and the noon boat the happiest sight.",
    "He tapped the barometer and said it aloud. Wind {wind}, force {force}, and the sky {sky_adj}.",
]

def fill(rng: random.Random, template: str) -> str:
    tasks = rng.sample(TASKS, 2)
    days = sorted(rng.sample(range(1, 500), 2))
    return template.format(
        wind=rng.choice(WIND), sea=rng.choice(SEA), sky=rng.choice(SKY_NOUN), sky_adj=rng.choice(SKY_ADJ),
        vessel=rng.choice(VESSELS), task=tasks[0], task2=tasks[1], name=rng.choice(NAMES),
        hour=f"{rng.randint(0, 23):02d}00", n=rng.randint(1, 12), force=rng.randint(1, 9),
        day=days[0], day2=days[1],
    )


def paragraph(rng: random.Random) -> str:
    """Three to six sentences of the prose, one or two a line (as tiny_corpus.txt has them)."""
    sentences = [fill(rng, t) for t in rng.sample(SENTENCES, rng.randint(3, 6))]
    lines = []
    while sentences:
        take = 2 if len(sentences) > 1 and rng.random() < 0.4 else 1
        lines.append(" ".join(sentences[:take]))
        sentences = sentences[take:]
    return "\n".join(lines) + "\n"


def main() -> None:
    rng = random.Random(11)
    here = Path(__file__).parent
    (here / "coast_prose.txt").write_text("\n".join(paragraph(rng) for _ in range(90)))


if __name__ == "__main__":
    main()
