"""The Hub tasks' rows against lighteval 0.13.0's strings, byte for byte.

For each of the nine multiple-choice tasks of SmolLM3's evaluation, about a dozen raw rows written in the
dataset's own fields, each with the context and the continuations lighteval 0.13.0 scores for it (its English
templates in lighteval/tasks/templates/, fed as SmolLM3's task definitions feed them, after
PromptManager._prepare_plain_text), written out by hand from reading those files: the capitalisation of the
question, the answers, HellaSwag's ctx_b and Winogrande's continuations, the trailing whitespace stripped, the
blank line and the strip of the templates that set an (empty) instruction, HellaSwag's WikiHow cleaning, the rows
lighteval skips. A few rows also in the lettered formulation (`:mc`). Then the task names (lighteval's aliases,
`:mc`), the splits, MMLU's subjects as groups and the rows a Hub task skips, through a stand-in for
`datasets.load_dataset`.
"""

from __future__ import annotations

import json

import pytest

from hf3d.evaluation import hub_tasks
from hf3d.evaluation.tasks import load_task, resolve

SKIP = None  # lighteval's template returns no document: the row is not scored


def arc_line(question: str, texts: list[str], key: str, labels: str = "ABCDE") -> dict:
    return {"question": question, "choices": {"text": texts, "label": list(labels[: len(texts)])}, "answerKey": key}


# (raw row, (query, choices, gold) or SKIP)
ARC = [
    (
        arc_line("Which is a source of heat?", ["the Sun", "ice", "snow", "a cloud"], "A"),
        ("Question: Which is a source of heat?\nAnswer:", [" The Sun", " Ice", " Snow", " A cloud"], 0),
    ),
    (
        arc_line("what melts ice? ", ["Heat ", "Cold"], "A"),
        ("Question: What melts ice?\nAnswer:", [" Heat", " Cold"], 0),
    ),
    (
        arc_line("Which planet is closest to the Sun?", ["Mercury", "Venus", "Earth", "Mars"], "1", "1234"),
        ("Question: Which planet is closest to the Sun?\nAnswer:", [" Mercury", " Venus", " Earth", " Mars"], 0),
    ),
    (
        arc_line("How many legs has a spider?", ["six", "four", "eight", "ten"], "3", "1234"),
        ("Question: How many legs has a spider?\nAnswer:", [" Six", " Four", " Eight", " Ten"], 2),
    ),
    (
        arc_line("Which is a mammal?", ["shark", "trout", "eel", "cod", "whale"], "E"),
        ("Question: Which is a mammal?\nAnswer:", [" Shark", " Trout", " Eel", " Cod", " Whale"], 4),
    ),
    (
        arc_line("What covers most of Earth?", ["water\n", "sand"], "A"),
        ("Question: What covers most of Earth?\nAnswer:", [" Water", " Sand"], 0),
    ),
    (
        arc_line("A student has this data:\nDay 1: 5 cm\nwhat grows?", ["a plant", "a rock"], "A"),
        ("Question: A student has this data:\nDay 1: 5 cm\nwhat grows?\nAnswer:", [" A plant", " A rock"], 0),
    ),
    (
        arc_line("How long is a day on Earth?", ["12 hours", "24 hours"], "B"),
        ("Question: How long is a day on Earth?\nAnswer:", [" 12 hours", " 24 hours"], 1),
    ),
    (
        arc_line("What pulls objects down?", [" gravity", "light"], "A"),
        ("Question: What pulls objects down?\nAnswer:", ["  gravity", " Light"], 0),
    ),
    (
        arc_line("Complete the sentence: plants need", ["éclairs", "über-light"], "B"),
        ("Question: Complete the sentence: plants need\nAnswer:", [" Éclairs", " Über-light"], 1),
    ),
    (
        arc_line("  why do leaves fall?", ["cold", "heat", "wind"], "C"),
        ("Question:   why do leaves fall?\nAnswer:", [" Cold", " Heat", " Wind"], 2),
    ),
    (
        arc_line("Which one conducts electricity?\t", ["copper.", "wood,"], "A"),
        ("Question: Which one conducts electricity?\nAnswer:", [" Copper.", " Wood,"], 0),
    ),
]

PIQA = [
    (
        {"goal": "How do I open a jar?", "sol1": "twist the lid counterclockwise.", "sol2": "hit it with a hammer.",
         "label": 0},
        ("Question: How do I open a jar?\nAnswer:", [" Twist the lid counterclockwise.", " Hit it with a hammer."], 0),
    ),
    (
        {"goal": "To make ice cubes", "sol1": "Fill a tray with water and freeze it.", "sol2": "Boil water.",
         "label": 0},
        ("Question: To make ice cubes\nAnswer:", [" Fill a tray with water and freeze it.", " Boil water."], 0),
    ),
    (
        {"goal": "remove rust \n", "sol1": "scrub with steel wool", "sol2": "paint over it", "label": 0},
        ("Question: Remove rust\nAnswer:", [" Scrub with steel wool", " Paint over it"], 0),
    ),
    (
        {"goal": "Clean a pan", "sol1": "use vinegar  ", "sol2": "use sand", "label": 1},
        ("Question: Clean a pan\nAnswer:", [" Use vinegar", " Use sand"], 1),
    ),
    (
        {"goal": "how to fold a shirt", "sol1": "Lay it flat.\nFold the sleeves in.", "sol2": "Crumple it.",
         "label": 0},
        ("Question: How to fold a shirt\nAnswer:", [" Lay it flat.\nFold the sleeves in.", " Crumple it."], 0),
    ),
    (
        {"goal": "Cook a yam", "sol1": "ñame is a yam: boil it", "sol2": "freeze it", "label": 0},
        ("Question: Cook a yam\nAnswer:", [" Ñame is a yam: boil it", " Freeze it"], 0),
    ),
    (
        {"goal": "Season soup", "sol1": "taste it", "sol2": " add salt", "label": 1},
        ("Question: Season soup\nAnswer:", [" Taste it", "  add salt"], 1),
    ),
    (
        {"goal": "Keep bread fresh?\t", "sol1": "Store it in a bag.", "sol2": "Leave it in the sun.", "label": 0},
        ("Question: Keep bread fresh?\nAnswer:", [" Store it in a bag.", " Leave it in the sun."], 0),
    ),
    (
        {"goal": "", "sol1": "a", "sol2": "b", "label": 1},
        ("Question: \nAnswer:", [" A", " B"], 1),
    ),
    (
        {"goal": "Water a plant", "sol1": "pour water on the soil", "sol2": "", "label": 0},
        ("Question: Water a plant\nAnswer:", [" Pour water on the soil", " "], 0),
    ),
    (
        {"goal": "[header] Tie a knot", "sol1": "loop, then pull.", "sol2": "cut the rope.", "label": 0},
        ("Question: [header] Tie a knot\nAnswer:", [" Loop, then pull.", " Cut the rope."], 0),
    ),
    (
        {"goal": "Dry wet shoes", "sol1": "stuff them with newspaper", "sol2": "PUT THEM IN THE OVEN", "label": 0},
        ("Question: Dry wet shoes\nAnswer:", [" Stuff them with newspaper", " PUT THEM IN THE OVEN"], 0),
    ),
]  # fmt: skip

MMLU = [
    (
        {"question": "What is 2 + 2?", "choices": ["3", "4", "5", "6"], "answer": 1,
         "subject": "elementary_mathematics"},
        ("Question: What is 2 + 2?\nAnswer:", [" 3", " 4", " 5", " 6"], 1),
    ),
    (
        {"question": "The longest bone in the human body is the", "choices": ["femur", "tibia", "humerus", "radius"],
         "answer": 0, "subject": "anatomy"},
        ("Question: The longest bone in the human body is the\nAnswer:", [" Femur", " Tibia", " Humerus", " Radius"],
         0),
    ),
    (
        {"question": "Which is a noble gas?", "choices": ["It is neon.", "oxygen", "iron", "salt"], "answer": 0,
         "subject": "high_school_chemistry"},
        ("Question: Which is a noble gas?\nAnswer:", [" It is neon.", " Oxygen", " Iron", " Salt"], 0),
    ),
    (
        {"question": "Find the degree of the extension Q(sqrt(2)) over Q.\n", "choices": ["0", "4", "2", "6"],
         "answer": 2, "subject": "abstract_algebra"},
        ("Question: Find the degree of the extension Q(sqrt(2)) over Q.\nAnswer:", [" 0", " 4", " 2", " 6"], 2),
    ),
    (
        {"question": "The ______ is the powerhouse of the cell.", "choices": ["nucleus", "mitochondrion", "wall",
         "membrane"], "answer": 1, "subject": "college_biology"},
        ("Question: The ______ is the powerhouse of the cell.\nAnswer:",
         [" Nucleus", " Mitochondrion", " Wall", " Membrane"], 1),
    ),
    (
        {"question": "Statement 1 | A group has an identity. Statement 2 | Every ring is a field.",
         "choices": ["True, True", "False, False", "True, False", "False, True"], "answer": 2,
         "subject": "abstract_algebra"},
        ("Question: Statement 1 | A group has an identity. Statement 2 | Every ring is a field.\nAnswer:",
         [" True, True", " False, False", " True, False", " False, True"], 2),
    ),
    (
        {"question": "Which are prime? I. 2 II. 4", "choices": ["I only", "II only", "(a) and (b)", "none"],
         "answer": 0, "subject": "elementary_mathematics"},
        ("Question: Which are prime? I. 2 II. 4\nAnswer:", [" I only", " II only", " (a) and (b)", " None"], 0),
    ),
    (
        {"question": "which of these is a verb?", "choices": ["run", "blue", "table", "quickly "], "answer": 0,
         "subject": "high_school_english"},
        ("Question: Which of these is a verb?\nAnswer:", [" Run", " Blue", " Table", " Quickly"], 0),
    ),
    (
        {"question": "\nThis question starts on a new line:", "choices": ["yes", "no", "maybe", "so"], "answer": 3,
         "subject": "formal_logic"},
        ("Question: \nThis question starts on a new line:\nAnswer:", [" Yes", " No", " Maybe", " So"], 3),
    ),
    (
        {"question": "What is the value of ∫x dx from 0 to 1?", "choices": ["1/2", "1", "2", "0"], "answer": 0,
         "subject": "college_mathematics"},
        ("Question: What is the value of ∫x dx from 0 to 1?\nAnswer:", [" 1/2", " 1", " 2", " 0"], 0),
    ),
    (
        {"question": "Who wrote Hamlet?  ", "choices": ["shakespeare", "marlowe", "jonson", "kyd"], "answer": 0,
         "subject": "world_religions"},
        ("Question: Who wrote Hamlet?\nAnswer:", [" Shakespeare", " Marlowe", " Jonson", " Kyd"], 0),
    ),
]  # fmt: skip


def csqa_line(question: str, texts: list[str], key: str) -> dict:
    return {"question": question, "choices": {"label": list("ABCDE"[: len(texts)]), "text": texts}, "answerKey": key}


COMMONSENSE_QA = [
    (
        csqa_line("Where would you find a seashell?", ["beach", "desert", "forest", "mountain", "city"], "A"),
        ("Question: Where would you find a seashell?\nAnswer:", [" Beach", " Desert", " Forest", " Mountain", " City"],
         0),
    ),
    (
        csqa_line("What do people do when tired?", ["run", "sing", "dance", "jump", "sleep"], "E"),
        ("Question: What do people do when tired?\nAnswer:", [" Run", " Sing", " Dance", " Jump", " Sleep"], 4),
    ),
    (
        csqa_line("Where is a good place to keep milk?", ["oven", "shelf", "refrigerator", "car", "bag"], " C"),
        ("Question: Where is a good place to keep milk?\nAnswer:",
         [" Oven", " Shelf", " Refrigerator", " Car", " Bag"], 2),
    ),
    (
        csqa_line("The man was cold, so he put on a what?  ", ["coat", "hat", "sock", "shoe", "ring"], "A"),
        ("Question: The man was cold, so he put on a what?\nAnswer:", [" Coat", " Hat", " Sock", " Shoe", " Ring"], 0),
    ),
    (
        csqa_line("what is a person likely to do after eating?", ["feel full", "starve", "fly", "swim", "dig"], "A"),
        ("Question: What is a person likely to do after eating?\nAnswer:",
         [" Feel full", " Starve", " Fly", " Swim", " Dig"], 0),
    ),
    (
        csqa_line("Where do fish live?", ["water ", "tree", "nest", "cave", "sky"], "A"),
        ("Question: Where do fish live?\nAnswer:", [" Water", " Tree", " Nest", " Cave", " Sky"], 0),
    ),
    (
        csqa_line("What can you use to cut paper?", ["scissors", "a spoon", "a cup", "a rock", "ice"], "A"),
        ("Question: What can you use to cut paper?\nAnswer:", [" Scissors", " A spoon", " A cup", " A rock", " Ice"],
         0),
    ),
    (
        csqa_line("If you're hungry, you should go to the what?", ["café", "bank", "gym", "pool", "park"], "A"),
        ("Question: If you're hungry, you should go to the what?\nAnswer:",
         [" Café", " Bank", " Gym", " Pool", " Park"], 0),
    ),
    (
        csqa_line("Where might a dog wait?", ["front door", "moon", "ocean", "cloud", "desk"], "B"),
        ("Question: Where might a dog wait?\nAnswer:", [" Front door", " Moon", " Ocean", " Cloud", " Desk"], 1),
    ),
    (
        csqa_line("James wanted to relax.\nwhere did he go?", ["spa", "war", "office", "jail", "exam"], "A"),
        ("Question: James wanted to relax.\nwhere did he go?\nAnswer:", [" Spa", " War", " Office", " Jail", " Exam"],
         0),
    ),
    (
        csqa_line("What is often on a desk?", ["computer\n", "horse", "boat", "river", "mountain"], "A"),
        ("Question: What is often on a desk?\nAnswer:", [" Computer", " Horse", " Boat", " River", " Mountain"], 0),
    ),
]  # fmt: skip


def obqa_line(stem: str, texts: list[str], key: str) -> dict:
    return {"question_stem": stem, "choices": {"text": texts, "label": list("ABCD")}, "answerKey": key}


OPENBOOKQA = [
    (
        obqa_line("The sun is responsible for", ["puppies learning new tricks", "children growing up and getting old",
                  "flowers wilting in a vase", "plants sprouting, blooming and wilting"], "D"),
        ("Question: The sun is responsible for\nAnswer:", [" Puppies learning new tricks",
         " Children growing up and getting old", " Flowers wilting in a vase",
         " Plants sprouting, blooming and wilting"], 3),
    ),
    (
        obqa_line("an example of a conductor is", ["a copper wire", "a rubber band", "a plastic cup", "wood"], "A"),
        ("Question: An example of a conductor is\nAnswer:", [" A copper wire", " A rubber band", " A plastic cup",
         " Wood"], 0),
    ),
    (
        obqa_line("When standing miles away from Mount Rushmore", ["the mountains seem very close",
                  "the mountains are boring", "the mountains look the same as from up close",
                  "the mountains seem smaller than in photographs"], "D"),
        ("Question: When standing miles away from Mount Rushmore\nAnswer:", [" The mountains seem very close",
         " The mountains are boring", " The mountains look the same as from up close",
         " The mountains seem smaller than in photographs"], 3),
    ),
    (
        obqa_line("Which is a renewable resource?", ["coal", "oil", "wind", "gas"], "C"),
        ("Question: Which is a renewable resource?\nAnswer:", [" Coal", " Oil", " Wind", " Gas"], 2),
    ),
    (
        obqa_line("A bird's nest is made of ", ["twigs ", "steel", "glass", "plastic"], "A"),
        ("Question: A bird's nest is made of\nAnswer:", [" Twigs", " Steel", " Glass", " Plastic"], 0),
    ),
    (
        obqa_line("Frogs lay eggs in", ["ponds", "deserts", "trees", "caves"], "A"),
        ("Question: Frogs lay eggs in\nAnswer:", [" Ponds", " Deserts", " Trees", " Caves"], 0),
    ),
    (
        obqa_line("What happens to water at 100 °C?", ["it boils", "it freezes", "it melts", "nothing"], "A"),
        ("Question: What happens to water at 100 °C?\nAnswer:", [" It boils", " It freezes", " It melts", " Nothing"],
         0),
    ),
    (
        obqa_line("Plants need which of these to grow:", ["light", "darkness", "salt", "oil"], "A"),
        ("Question: Plants need which of these to grow:\nAnswer:", [" Light", " Darkness", " Salt", " Oil"], 0),
    ),
    (
        obqa_line("the moon orbits", ["the Earth", "Mars", "the Sun only", "nothing"], "A"),
        ("Question: The moon orbits\nAnswer:", [" The Earth", " Mars", " The Sun only", " Nothing"], 0),
    ),
    (
        obqa_line("Magnets attract", ["iron", "wood", "paper", "glass."], "A"),
        ("Question: Magnets attract\nAnswer:", [" Iron", " Wood", " Paper", " Glass."], 0),
    ),
    (
        obqa_line("Heat moves from", ["hot to cold", "cold to hot", " nowhere", "up"], "A"),
        ("Question: Heat moves from\nAnswer:", [" Hot to cold", " Cold to hot", "  nowhere", " Up"], 0),
    ),
    (
        obqa_line("A seed becomes\na", ["plant", "rock", "cloud", "fish"], "A"),
        ("Question: A seed becomes\na\nAnswer:", [" Plant", " Rock", " Cloud", " Fish"], 0),
    ),
]  # fmt: skip

YES_NO = [" Yes", " No"]
BOOLQ = [
    (
        {"question": "is the sky blue", "passage": "The sky is blue.", "answer": True},
        ("\n\nThe sky is blue.\nQuestion: Is the sky blue\nAnswer:", YES_NO, 0),
    ),
    (
        {"question": "is the sky green", "passage": "The sky is blue.", "answer": False},
        ("\n\nThe sky is blue.\nQuestion: Is the sky green\nAnswer:", YES_NO, 1),
    ),
    (
        {"question": "is persian a language", "passage": " Persian is spoken in Iran.", "answer": True},
        ("\n\nPersian is spoken in Iran.\nQuestion: Is persian a language\nAnswer:", YES_NO, 0),
    ),
    (
        {"question": "is ethanol a fuel", "passage": "ethanol fuel is ethyl alcohol.", "answer": True},
        ("\n\nEthanol fuel is ethyl alcohol.\nQuestion: Is ethanol a fuel\nAnswer:", YES_NO, 0),
    ),
    (
        {"question": "does it rain in the desert", "passage": "Deserts get little rain.\n", "answer": True},
        ("\n\nDeserts get little rain.\nQuestion: Does it rain in the desert\nAnswer:", YES_NO, 0),
    ),
    (
        {"question": "do iran and afghanistan speak the same language?", "passage": "Persian is spoken in both.",
         "answer": True},
        ("\n\nPersian is spoken in both.\nQuestion: Do iran and afghanistan speak the same language?\nAnswer:", YES_NO,
         0),
    ),
    (
        {"question": "is water wet", "passage": "", "answer": True},
        ("\n\nQuestion: Is water wet\nAnswer:", YES_NO, 0),
    ),
    (
        {"question": "is water dry", "passage": " ", "answer": False},
        ("\n\nQuestion: Is water dry\nAnswer:", YES_NO, 1),
    ),
    (
        {"question": " is it late", "passage": "It is late.", "answer": True},
        ("\n\nIt is late.\nQuestion:  is it late\nAnswer:", YES_NO, 0),
    ),
    (
        {"question": "is the question trailing  ", "passage": "A passage.\n\nWith two paragraphs.", "answer": False},
        ("\n\nA passage.\n\nWith two paragraphs.\nQuestion: Is the question trailing\nAnswer:", YES_NO, 1),
    ),
    (
        {"question": "is élan a word", "passage": "élan means energy.", "answer": True},
        ("\n\nÉlan means energy.\nQuestion: Is élan a word\nAnswer:", YES_NO, 0),
    ),
]  # fmt: skip


def hs_line(label: str, ctx_a: str, ctx_b: str, endings: list[str], gold: str) -> dict:
    return {"activity_label": label, "ctx_a": ctx_a, "ctx_b": ctx_b, "endings": endings, "label": gold}


HELLASWAG = [
    (
        hs_line("Removing ice from car", "Then, the man writes over the snow covering the window of a car, and a "
                "woman wearing winter clothes smiles.", "then", [", the man adds wax to the windshield and cuts it.",
                ", the man continues removing the snow on his car."], "1"),
        ("\n\nRemoving ice from car:\nThen, the man writes over the snow covering the window of a car, and a woman "
         "wearing winter clothes smiles. Then", [" , the man adds wax to the windshield and cuts it.",
         " , the man continues removing the snow on his car."], 1),
    ),
    (
        hs_line("Baking cookies", "A woman puts flour in a bowl", "she stirs it", ["with a spoon.", "on the floor."],
                "0"),
        ("\n\nBaking cookies:\nA woman puts flour in a bowl she stirs it", [" with a spoon.", " on the floor."], 0),
    ),
    (
        hs_line("Home and Garden", "[header] How to clean a grill [title] Heat the grill. [step] Turn it on high for "
                "15 minutes.", "", ["[substeps] Use a brush. [title] Scrub the grates.", "Throw it away."], "0"),
        ("\n\nHome and Garden:\nHow to clean a grill. Heat the grill. Turn it on high for 15 minutes.",
         [" Use a brush.. Scrub the grates.", " Throw it away."], 0),
    ),
    (
        hs_line("Home and Garden", "[header] How to rinse a grill.", "", ["[title] Rinse the grill.", "Burn it."],
                "0"),
        ("\n\nHome and Garden:\nHow to rinse a grill.", [" Rinse the grill.", " Burn it."], 0),
    ),
    (
        hs_line("Cooking", "Is it ready?", "yes it is", ["the chef says.", "he sighs."], "0"),
        ("\n\nCooking:\nIs it ready? Yes it is", [" the chef says.", " he sighs."], 0),
    ),
    (
        hs_line("Roof shingle removal", "A man is sitting on a roof.  ", "he", ["is using wrap to wrap a pair of skis.",
                "Starts pulling up roofing on a roof."], "1"),
        ("\n\nRoof shingle removal:\nA man is sitting on a roof. He", [" is using wrap to wrap a pair of skis.",
         " starts pulling up roofing on a roof."], 1),
    ),
    (
        hs_line("washing dishes", "The sink is full.", "a woman", ["Turns on the tap.", "leaves the room."], "0"),
        ("\n\nWashing dishes:\nThe sink is full. A woman", [" turns on the tap.", " leaves the room."], 0),
    ),
    (
        hs_line("", "the cat sat", "", ["On the mat.", "on the dog."], "0"),
        ("\n\nThe cat sat", [" on the mat.", " on the dog."], 0),
    ),
    (hs_line("Grilling", "A grill is hot.", "", ["[title]", "Fine."], "1"), SKIP),
    (
        hs_line("Running", "The man stands up", "Then", ["he runs.", "He sits."], "0"),
        ("\n\nRunning:\nThe man stands up then", [" he runs.", " he sits."], 0),
    ),
    (
        hs_line("Sports", "", "a man runs.", ["He wins.", "he falls."], "0"),
        ("\n\nSports:\n A man runs.", [" He wins.", " He falls."], 0),
    ),
    (
        hs_line("Running", "The  man   jumps", "", ["wins the race. ", "falls  down."], "0"),
        ("\n\nRunning:\nThe man  jumps", [" wins the race.", " falls down."], 0),
    ),
    (
        hs_line("Typing", "She types a path.", "", ["It reads go \\.+ now.", "It reads stop."], "1"),
        ("\n\nTyping:\nShe types a path.", [" It reads go \\. now.", " It reads stop."], 1),
    ),
]  # fmt: skip


def wg_line(sentence: str, option1: str, option2: str, answer: str) -> dict:
    return {"sentence": sentence, "option1": option1, "option2": option2, "answer": answer}


WINOGRANDE = [
    (
        wg_line("Sarah was a much better surgeon than Maria so _ always got the harder cases.", "Sarah", "Maria", "1"),
        ("\n\nSarah was a much better surgeon than Maria so",
         [" sarah  always got the harder cases.", " maria  always got the harder cases."], 0),
    ),
    (
        wg_line("The trophy doesn't fit into the brown suitcase. _ is too large.", "The trophy", "The suitcase", "1"),
        ("\n\nThe trophy doesn't fit into the brown suitcase.", [" The trophy  is too large.",
         " The suitcase  is too large."], 0),
    ),
    (wg_line("_ went to the store.", "Ann", "Bob", "1"), SKIP),
    (wg_line("_ and _ went to the store.", "Ann", "Bob", "1"), SKIP),
    (wg_line("Nobody went to the store.", "Ann", "Bob", "1"), SKIP),
    (
        wg_line("I poured water from the bottle into the cup until _", "the bottle", "the cup", "2"),
        ("\n\nI poured water from the bottle into the cup until", [" the bottle", " the cup"], 1),
    ),
    (
        wg_line("He asked Tom for help because _'s car broke.", "Tom", "he", "1"),
        ("\n\nHe asked Tom for help because", [" tom 's car broke.", " he 's car broke."], 0),
    ),
    (
        wg_line("the cat chased the mouse because _ was hungry.", "the cat", "the mouse", "1"),
        ("\n\nThe cat chased the mouse because", [" the cat  was hungry.", " the mouse  was hungry."], 0),
    ),
    (
        wg_line(" ok so _ left.", "Ann", "Bob", "2"),
        ("\n\nok so", [" ann  left.", " bob  left."], 1),
    ),
    (
        wg_line("The nurse called for Dr. Smith because _ needed help.", "Dr. Smith", "the nurse", "2"),
        ("\n\nThe nurse called for Dr. Smith because", [" dr. Smith  needed help.", " the nurse  needed help."], 1),
    ),
    (
        wg_line("Here is the answer: _ was right.", "mary", "john", "1"),
        ("\n\nHere is the answer:", [" Mary  was right.", " John  was right."], 0),
    ),
    (
        wg_line("Why did Ann call Bob? _ needed a ride. ", "Ann", "Bob", "1"),
        ("\n\nWhy did Ann call Bob?", [" Ann  needed a ride.", " Bob  needed a ride."], 0),
    ),
]  # fmt: skip

CASES = {
    "arc_easy": ARC,
    "arc_challenge": ARC,
    "piqa": PIQA,
    "mmlu": MMLU,
    "commonsense_qa": COMMONSENSE_QA,
    "openbookqa": OPENBOOKQA,
    "boolq": BOOLQ,
    "hellaswag": HELLASWAG,
    "winogrande": WINOGRANDE,
}

# the lettered formulation (lighteval's MCF) of a row of each template
LETTERED = {
    "arc_easy": (
        ARC[0][0],
        ("Question: Which is a source of heat?\n A. The Sun\n B. Ice\n C. Snow\n D. A cloud\nAnswer:",
         [" A", " B", " C", " D"], 0),
    ),
    "boolq": (
        BOOLQ[1][0],
        ("\n\nThe sky is blue.\nQuestion: Is the sky green\n A. Yes\n B. No\nAnswer:", [" A", " B"], 1),
    ),
    "hellaswag": (
        HELLASWAG[1][0],
        ("\n\nBaking cookies:\nA woman puts flour in a bowl she stirs it\n A. with a spoon.\n B. on the floor.\n"
         "Answer:", [" A", " B"], 0),
    ),
    "winogrande": (
        WINOGRANDE[1][0],
        ("\n\nThe trophy doesn't fit into the brown suitcase.\n A. The trophy  is too large.\n B. The suitcase  is "
         "too large.\nAnswer:", [" A", " B"], 0),
    ),
    "piqa": (
        PIQA[3][0],
        ("Question: Clean a pan\n A. Use vinegar\n B. Use sand\nAnswer:", [" A", " B"], 1),
    ),
}  # fmt: skip


def _row(name: str, line: dict, lettered: bool = False):
    value = hub_tasks.HUB_TASKS[name].mapping("lighteval", lettered)(line)
    return None if value is None else (value["query"], value["choices"], value["gold"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_hub_task_writes_lightevals_strings(name):
    """Byte for byte: every row's context and continuations, and the rows skipped. Mutations: dropping the
    capitalisation of answers, the blank line of the prepared prompt, the strip of trailing whitespace, or
    HellaSwag's newline after the label each fail several tasks."""
    assert len(CASES[name]) >= 11
    for i, (line, want) in enumerate(CASES[name]):
        got = _row(name, line)
        assert got == want, f"{name} row {i}:\n got  {got!r}\n want {want!r}"


@pytest.mark.parametrize("name", sorted(LETTERED))
def test_the_lettered_formulation_writes_lightevals_strings(name):
    line, want = LETTERED[name]
    assert _row(name, line, lettered=True) == want


def test_every_hub_task_is_checked_against_lightevals_strings():
    multiple_choice = {name for name, spec in hub_tasks.HUB_TASKS.items() if not spec.generative}
    assert set(CASES) == multiple_choice


def test_lightevals_task_names_and_the_lettered_suffix_name_hf3ds_tasks(tmp_path):
    assert resolve("hellaswag_cf") == resolve("hellaswag") == resolve("hellaswag").__class__("hub", "hellaswag")
    assert (resolve("arc_cf:easy").target, resolve("arc_cf:easy").lettered) == ("arc_easy", False)
    assert (resolve("arc_mcf:challenge").target, resolve("arc_mcf:challenge").lettered) == ("arc_challenge", True)
    assert resolve("commonsenseqa_cf").target == "commonsense_qa" and resolve("boolq_cf").target == "boolq"
    assert resolve("winogrande:mc").lettered and resolve("shakespeare-word:mc").kind == "shipped"
    task = tmp_path / "mine.jsonl"
    task.write_text(json.dumps({"query": "Q: two?\n", "choices": [" one", "two "], "gold": 1}) + "\n")
    (row,) = load_task(f"{task}:mc").rows
    assert (row.query, row.choices, row.gold) == ("Q: two?\n A. one\n B. two\nAnswer:", (" A", " B"), 1)
    assert load_task(f"{task}:mc").name == "mine:mc"
    with pytest.raises(ValueError, match=r"^task 'gsm8k:mc': gsm8k is generative, it has no lettered formulation"):
        resolve("gsm8k:mc")
    with pytest.raises(ValueError, match=r"^unknown task 'hellaswag_fc': did you mean 'hellaswag_cf'\?"):
        resolve("hellaswag_fc")


def test_a_hub_task_reads_smollm3s_split_skips_what_lighteval_skips_and_groups_mmlus_subjects(monkeypatch):
    """Through a stand-in for datasets.load_dataset: OpenBookQA's validation split under lighteval's prompts
    (SmolLM3's) and its test split under the harness's (SmolLM2's); two Winogrande rows lighteval skips, named
    in the source; MMLU's subjects as groups under lighteval's prompts only."""
    import datasets

    asked = []

    def load_dataset(repo, subset=None, split=None):
        asked.append((repo, split))
        return {"allenai/winogrande": [line for line, _ in WINOGRANDE], "cais/mmlu": [line for line, _ in MMLU],
                "allenai/openbookqa": [line for line, _ in OPENBOOKQA]}[repo]  # fmt: skip

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    task = load_task("winogrande_cf")
    assert task.name == "winogrande" and len(task.rows) == len(WINOGRANDE) - 3
    assert ", lighteval 0.13.0 cloze prompts (CF), " in task.source and "9 rows (3 skipped" in task.source
    assert load_task("openbookqa").rows[0].query.startswith("Question: The sun")
    load_task("openbookqa", prompt_style="harness")
    assert asked[-2:] == [("allenai/openbookqa", "validation"), ("allenai/openbookqa", "test")]
    assert [r.group for r in load_task("mmlu").rows[:2]] == ["elementary_mathematics", "anatomy"]
    assert {r.group for r in load_task("mmlu", prompt_style="harness").rows} == {None}
    lettered = load_task("mmlu:mc", prompt_style="harness")  # the lettered rows are lighteval's whatever the style
    assert lettered.name == "mmlu:mc" and lettered.rows[0].choices == (" A", " B", " C", " D")


def test_a_hub_task_goes_offline_as_a_file_of_its_raw_rows_and_says_at_once_when_the_hub_is_away(monkeypatch, tmp_path):
    """`hf3d fetch-tasks hellaswag --raw-dir DIR` writes the dataset's rows as they are; `--tasks hellaswag=FILE`
    maps them by the same prompts to the same rows as the Hub's. Where the Hub cannot be reached, the datasets
    cache alone is read (offline mode, no retries) and one line says both."""
    import datasets
    import huggingface_hub.constants as hub

    from hf3d.evaluation.tasks import fetch_tasks

    offline_at_load = []
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)

    def load_dataset(repo, subset=None, split=None):
        offline_at_load.append(hub.HF_HUB_OFFLINE)
        if repo != "Rowan/hellaswag":
            raise ConnectionError(f"Couldn't reach {repo!r} on the Hub (OfflineModeIsEnabled)")
        return [line for line, _ in HELLASWAG]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(hub_tasks, "_HUB_AWAY", [None])  # the Hub answers
    (line,) = fetch_tasks("hellaswag", raw_dir=str(tmp_path / "raw"))
    raw = tmp_path / "raw" / "hellaswag.jsonl"
    assert line.startswith("hellaswag: Rowan/hellaswag, split validation, revision unknown, ") and str(raw) in line
    assert [json.loads(x) for x in raw.read_text().splitlines()] == [line for line, _ in HELLASWAG]
    from_hub, from_file = load_task("hellaswag"), load_task(f"hellaswag={raw}")
    assert from_file.rows == from_hub.rows and from_file.name == "hellaswag"
    assert from_file.source.startswith(f"{raw} (raw rows of Rowan/hellaswag, split validation), lighteval 0.13.0")
    assert load_task(f"hellaswag_cf={raw}").rows == from_hub.rows and offline_at_load == [False, False]
    with pytest.raises(ValueError, match=r"NAME=FILE takes a Hub task's name \('shakespeare-word' is not one\)"):
        resolve(f"shakespeare-word={raw}")
    with pytest.raises(ValueError, match=r"fetch-tasks fetches Hub tasks by name"):
        fetch_tasks(f"hellaswag={raw}")
    away = "the Hub (https://huggingface.co) cannot be reached (ConnectError)"
    monkeypatch.setattr(hub_tasks, "_HUB_AWAY", [away])
    with pytest.raises(ValueError) as e:
        load_task("piqa")
    assert str(e.value) == (
        f"task 'piqa' reads the Hub dataset ybisk/piqa, split validation: it is not in the datasets cache and {away}; "
        "run `hf3d fetch-tasks piqa` where the Hub is reachable (into the cache, or --raw-dir DIR for a file to pass "
        "as NAME=FILE), or pass the task as a JSONL file of {query, choices, gold} rows"
    )
    assert offline_at_load[-1] is True and hub.HF_HUB_OFFLINE is False  # the cache alone, then as it was
