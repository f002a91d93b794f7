"""The built-in corpus every embedding model is calibrated on at warm-up, for int8/uint8 output.

int8 and uint8 embeddings need a scale: one per model (and output width), ``int8 = round(x / scale)``,
symmetric, so zero stays zero and a plain integer dot product ranks like the float one (a per-dimension
range with an offset, as sentence-transformers' ``quantize_embeddings`` calibrates, biases each
document's dot product by its own offset term and loses about a seventh of the top-10 neighbours).
The scale is the :data:`INT8_PERCENTILE` th percentile of the corpus rows' absolute values over 127:
near their maximum, so almost nothing is clipped, yet one outlying dimension cannot spread the steps.
Computed per request it would make a text's bytes depend on its neighbours; computed here, once, from a
fixed corpus, the same text always gets the same bytes. The corpus is short everyday sentences in
eight topics, so it also serves the retrieval check of binary output (neighbours by Hamming distance
against cosine).

``coalesce export`` embeds the corpus once with the exported graph and stores the rows beside it
(``calibration.npy``, named by :func:`digest` in the manifest, with the scale those rows give as the
manifest's ``int8_scale``: :func:`stored_int8_scale`), so a server of the export starts without
embedding it again; the engine embeds it at warm-up for every other model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .protocol import Tokens

BATCH = 32  # sequences per batch of the corpus
FILE = "calibration.npy"  # in an export directory: the rows, float32 (len(CORPUS), dim)
# The percentile of |x| over the corpus rows that int8's ±127 stands for. On real text (paragraphs of
# Python's documentation) all-MiniLM-L6-v2 keeps recall@10 0.994 here, 0.995 at the maximum, 0.991 at
# 99.9 and 0.971 at 99: past 99.99 only a handful of the corpus's values are clipped.
INT8_PERCENTILE = 99.99
INT8_MAX = 127  # int8 output spans -127..127 (symmetric); uint8 = int8 + 128 spans 1..255

TOPICS: dict[str, tuple[str, ...]] = {
    "cooking": (
        "Knead the dough for ten minutes until it feels smooth and elastic.",
        "A sourdough starter needs flour and water every day to stay active.",
        "Roast the vegetables at a high heat so their edges caramelise.",
        "Salt the pasta water generously before the noodles go in.",
        "Let the steak rest for a few minutes after it comes off the grill.",
        "Whisk the eggs and sugar until the mixture turns pale and thick.",
        "Simmer the tomato sauce slowly to deepen its flavour.",
        "Fresh herbs should be added at the end of cooking.",
        "A cast iron pan holds heat well and browns meat evenly.",
        "Proof the bread in a warm place until it doubles in size.",
        "Toast the spices in a dry pan before grinding them.",
        "Deglaze the pan with wine to lift the browned bits from the bottom.",
    ),
    "astronomy": (
        "The Moon always shows the same face to the Earth.",
        "Jupiter is the largest planet in the solar system.",
        "A light year is the distance light travels in one year.",
        "Stars are born inside huge clouds of gas and dust.",
        "The Sun will become a red giant in about five billion years.",
        "Saturn's rings are made mostly of ice and rock.",
        "A telescope gathers light to show faint and distant galaxies.",
        "Black holes bend light so strongly that nothing escapes them.",
        "Mars has the tallest volcano known in the solar system.",
        "Comets grow bright tails when they pass close to the Sun.",
        "The Milky Way contains hundreds of billions of stars.",
        "Eclipses happen when the Moon lines up between the Earth and the Sun.",
    ),
    "football": (
        "The striker scored twice in the second half to win the match.",
        "The goalkeeper saved a penalty in the final minute.",
        "The coach changed the formation at half time.",
        "Fans filled the stadium for the cup final.",
        "A yellow card was shown for a late tackle in midfield.",
        "The team won the league title on the last day of the season.",
        "The winger crossed the ball into the box for a header.",
        "Extra time ended level, so the game went to penalties.",
        "The club signed a young defender from the academy.",
        "The referee checked the video before allowing the goal.",
        "Both teams struggled to create chances in a tense derby.",
        "The captain lifted the trophy in front of the home crowd.",
    ),
    "computing": (
        "The database index made the slow query ten times faster.",
        "A memory leak caused the server to crash every night.",
        "The compiler turns source code into machine instructions.",
        "Unit tests catch bugs before the code reaches production.",
        "The network request timed out after thirty seconds.",
        "A load balancer spreads traffic over several servers.",
        "The cache stores recent results so repeated requests are quick.",
        "The function returns an error when the file does not exist.",
        "Version control keeps the history of every change to the code.",
        "The graphics card runs thousands of small calculations in parallel.",
        "Encrypting the disk protects data if the laptop is stolen.",
        "The queue holds incoming jobs until a worker is free.",
    ),
    "gardening": (
        "Tomato plants need plenty of sun and regular watering.",
        "Prune the roses in late winter before new growth starts.",
        "Compost adds nutrients and improves the structure of the soil.",
        "Slugs come out at night and eat young lettuce leaves.",
        "Plant the bulbs in autumn for flowers in spring.",
        "Mulch keeps moisture in the soil during dry weeks.",
        "Seedlings should be hardened off before planting outside.",
        "Bees visit the lavender all through the summer.",
        "Water the garden early in the morning to reduce evaporation.",
        "Fruit trees are grafted onto rootstock that controls their size.",
        "Weeds compete with the vegetables for water and light.",
        "Rotate the crops each year to keep the soil healthy.",
    ),
    "health": (
        "Regular exercise strengthens the heart and lungs.",
        "Drinking enough water helps the body regulate its temperature.",
        "Sleep gives the brain time to consolidate memories.",
        "Vaccines train the immune system to recognise a virus.",
        "A balanced diet includes fruit, vegetables and whole grains.",
        "Stretching after a run can reduce muscle stiffness.",
        "Too much sugar increases the risk of tooth decay.",
        "Wash your hands to stop germs from spreading.",
        "High blood pressure often has no obvious symptoms.",
        "Walking every day is good for long term health.",
        "Sunscreen protects the skin from ultraviolet light.",
        "A doctor may recommend rest and fluids for a cold.",
    ),
    "finance": (
        "Interest rates rose for the third time this year.",
        "The company reported higher profits than analysts expected.",
        "Diversifying investments spreads the risk across many assets.",
        "Inflation reduces the purchasing power of savings.",
        "The central bank sets the base rate for lending.",
        "Shares fell sharply after the earnings warning.",
        "A budget helps track income and monthly spending.",
        "Bonds pay a fixed amount of interest until they mature.",
        "The mortgage is repaid over twenty five years.",
        "Currency markets react quickly to economic news.",
        "The startup raised money from venture capital investors.",
        "Paying off credit card debt early saves on interest.",
    ),
    "travel": (
        "The train to the coast leaves every hour from the main station.",
        "Book the flight early to get a cheaper fare.",
        "The old town is best explored on foot.",
        "Remember to check that your passport has not expired.",
        "The hotel offers breakfast on a terrace overlooking the sea.",
        "A ferry connects the two islands twice a day.",
        "The museum is closed on Mondays.",
        "Hiking trails wind through the mountains above the village.",
        "Carry some local currency for markets and small shops.",
        "The night bus is the cheapest way to cross the country.",
        "Travel insurance covers lost luggage and medical bills.",
        "The guide showed us the ruins of an ancient temple.",
    ),
}

CORPUS: tuple[str, ...] = tuple(s for sentences in TOPICS.values() for s in sentences)


def int8_scale(calibration: np.ndarray) -> float:
    """int8/uint8 output's step for rows like ``calibration`` (corpus × width): the
    :data:`INT8_PERCENTILE` th percentile of their absolute values over :data:`INT8_MAX`, so
    ``x ≈ int8 × scale``. 1.0 for all-zero rows."""
    top = float(np.percentile(np.abs(np.asarray(calibration, dtype=np.float32)), INT8_PERCENTILE))
    return top / INT8_MAX if top > 0 else 1.0


def stored_int8_scale(directory: Path) -> float:
    """The scale of the calibration rows an export stored in ``directory`` (what ``coalesce export``
    writes as the manifest's ``int8_scale``), or 0.0 where it stored none."""
    path = Path(directory) / FILE
    return int8_scale(np.load(path, allow_pickle=False)) if path.is_file() else 0.0


def digest() -> str:
    """Names this corpus: stored calibration rows count only when made from the same sentences."""
    return hashlib.sha256("\n".join(CORPUS).encode()).hexdigest()[:16]


def corpus_batches(tokens: Tokens) -> list[list[list[int]]]:
    """The corpus as the batches of complete id sequences (no prompt) its rows are computed from, in
    order, wherever they are computed: the same batches everywhere (an int8 export from before static
    quantisation scales its activations per batch, so its rows depend on their batch)."""
    seqs = [tokens.with_special_tokens(ids) for ids in tokens.tokenize(CORPUS)]
    return [seqs[i : i + BATCH] for i in range(0, len(seqs), BATCH)]
