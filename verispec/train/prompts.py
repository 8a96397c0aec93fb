"""The built-in prompt set of ``verispec train-draft``: request templates x subjects.

A head generalises to prompts it has not seen only if its data covers many kinds of request
(stories, explanations, lists, letters, dialogues, how-tos, comparisons...) about many kinds of
subject, so the set is a product of both, shuffled with a seed. Every template takes any subject
(a noun phrase). The prompts of ``verispec bench --prompts free`` are held out: none of them is
in the set, and no subject here is one of theirs (lighthouse keepers, the colour of the sky,
learning languages, autumn, blacksmiths, viruses and bacteria, board games, cats and dogs,
dreams, painting robots), so that benchmark measures prompts the head never trained on.
"""

from __future__ import annotations

import itertools
import random

from verispec.bench.prompts import FREE_PROMPTS

TEMPLATES = (
    "Write a short story about {}.",
    "Explain {} to a curious twelve-year-old.",
    "What are the most important facts about {}?",
    "Write a poem about {}.",
    "Give three practical tips related to {}.",
    "Describe {} in a few paragraphs.",
    "What are common misconceptions about {}?",
    "Write a dialogue between two friends discussing {}.",
    "Summarise the history of {} briefly.",
    "Why do people care about {}? Answer in a short essay.",
    "Write a blog post introduction about {}.",
    "List five interesting questions someone might ask about {}, with short answers.",
    "Write a friendly email to a colleague about {}.",
    "What are the advantages and disadvantages of {}?",
    "Tell a funny story involving {}.",
    "How would you teach a beginner about {}? Give a step-by-step plan.",
    "Write a diary entry of someone who spent the day thinking about {}.",
    "Compare {} with something similar and explain the differences.",
    "Write a news report about {}.",
    "What would the world be like without {}?",
    "Give a short speech about {} for a school assembly.",
    "Write a fairy tale in which {} plays an important part.",
    "What should a visitor know about {}?",
    "Describe how {} has changed over the last hundred years.",
    "Write a product description that mentions {}.",
    "Explain the science behind {}.",
    "Write a limerick and then a haiku about {}.",
    "What advice would you give to someone who is nervous about {}?",
    "Write an encyclopedia-style entry about {}.",
    "Imagine you are a tour guide. Talk about {}.",
    "What are the biggest challenges related to {} today?",
    "Write a motivational message inspired by {}.",
)

SUBJECTS = (
    # nature and places
    "the moon", "volcanoes", "honeybees", "the ocean at night", "winter in the mountains",
    "rivers", "the desert", "forests", "earthquakes", "penguins", "coral reefs", "thunderstorms",
    "glaciers", "the rainforest", "owls", "elephants", "a quiet lake", "tides", "mushrooms",
    "migrating birds", "a small island", "caves", "wolves", "sunflowers", "the Arctic",
    "whales", "a city park", "an old bridge", "a mountain village", "a busy harbour",
    # science and technology
    "the solar system", "the human heart", "electric cars", "the internet", "the brain",
    "mathematics", "a space station", "photosynthesis", "magnets", "gravity", "batteries",
    "solar panels", "the immune system", "telescopes", "3D printing", "smartphones",
    "artificial intelligence", "vaccines", "electricity", "the water cycle", "DNA",
    "airplanes", "computer programming", "recycling plastic", "satellites", "microscopes",
    # people and work
    "a small bakery", "a detective in a quiet town", "a nurse on a night shift",
    "a farmer during harvest", "a young inventor", "a firefighter", "a school teacher",
    "a street musician", "an astronaut", "a librarian", "a chef in a busy restaurant",
    "a mail carrier", "a grandmother's recipes", "a shy student", "a ship captain",
    "a zookeeper", "a carpenter", "a marathon runner", "a mountain guide",
    # history and culture
    "ancient Egypt", "the Roman Empire", "the printing press", "old libraries", "the Vikings",
    "the invention of the wheel", "the first airplanes", "castles", "the Silk Road",
    "the Olympic Games", "ancient Greece", "pyramids", "the telephone", "trains",
    "museums", "folk music", "theatre", "jazz", "origami", "pottery",
    # everyday life
    "learning to cook", "a train journey", "the first day of school", "friendship",
    "gardening", "a rainy afternoon", "chess", "music and memory", "recycling",
    "healthy sleep", "photography", "saving money", "time management", "bicycles",
    "birthday parties", "coffee", "tea", "moving to a new city", "a family picnic",
    "camping", "running a marathon", "public transport", "a job interview", "kindness",
    "keeping a journal", "video games", "breakfast", "a lost umbrella", "a haunted house",
    "a friendly dragon", "a pirate ship", "a treasure map", "a snowy holiday",
    "volunteering", "football", "swimming", "homework", "a birthday cake", "bread",
    # more of each kind
    "a waterfall", "hummingbirds", "the northern lights", "octopuses", "rainbows",
    "hurricanes", "a meadow in spring", "ants", "dolphins", "tigers", "a bamboo forest",
    "frogs", "comets", "snowflakes", "fossils", "dinosaurs", "the periodic table",
    "nuclear energy", "submarines", "rockets", "wind turbines", "cameras", "the human skeleton",
    "antibiotics", "clean drinking water", "search engines", "maps and navigation", "lasers",
    "weather forecasts", "a beekeeper", "a lifeguard", "a bus driver", "a veterinarian",
    "an architect", "a tailor", "a fisherman", "a pharmacist", "a journalist", "a park ranger",
    "a watchmaker", "the Great Wall of China", "the Renaissance", "samurai", "the Aztecs",
    "the Industrial Revolution", "the steam engine", "the first cars", "opera", "ballet",
    "calligraphy", "the Moon landing", "a farmers' market", "a snow day", "a first job",
    "a school play", "a road trip", "a power cut", "growing tomatoes", "a wedding",
    "pancakes", "knitting", "yoga", "a lost key", "online shopping", "a science fair",
    "a ferry ride",
)


def builtin_prompts(seed: int = 0) -> list[str]:
    """Every template x subject, shuffled with ``seed``, without the ``free`` bench prompts."""
    held_out = set(FREE_PROMPTS)
    prompts = [t.format(s) for t, s in itertools.product(TEMPLATES, SUBJECTS)]
    prompts = [p for p in prompts if p not in held_out]
    random.Random(seed).shuffle(prompts)
    return prompts
