"""Everyday chat between two friends: the bulk of every session, none of it evidence.

Exchanges are built from slot templates (an opener, a reaction, often a question back and
its answer), with short replies, long rambling stories, photos shown as "[image: ...]"
captions the way chat exports carry them, lowercase unpunctuated turns and emoji. Topics
are the ordinary ones (work, weather, food, TV, family), so recall has to tell a turn that
mentions the same words apart from the turn that answers.
"""

from __future__ import annotations

import random

NAMES = ("Priya", "Tom", "Amara", "Kenji", "Sofia", "Mateo", "Olga", "Kwame", "Aisha", "Lars", "Mei", "Diego",
         "Fatima", "Jonas", "Ananya", "Luca", "Zanele", "Hiroshi", "Camille", "Tariq", "Ingrid", "Rafael",
         "Nadia", "Emeka", "Chloe", "Arjun", "Yasmin", "Bjorn", "Lucia", "Tunde", "Mira", "Pavel", "Grace",
         "Omar", "Elif", "Santiago")
FEMALE = frozenset({"Priya", "Amara", "Sofia", "Olga", "Aisha", "Mei", "Fatima", "Ananya", "Zanele", "Camille",
                    "Ingrid", "Nadia", "Chloe", "Yasmin", "Lucia", "Mira", "Grace", "Elif"})
OTHERS = ("Kofi", "Ana", "Ravi", "Hannah", "Marek", "Leila", "Sam", "Bea", "Yusuf", "Julia", "Dev", "Rosa",
          "Felix", "Nkechi", "Oscar", "Lina", "Hugo", "Mariam", "Theo", "Carmen")

GREET = ("Hey {o}! Long time no talk", "Hi!! how was your week?", "heyyy", "{o}!! you alive?",
         "Hey, got a minute?", "Hello hello", "Hi {o}, how are things?", "yo", "Hey you 😊")
GREET_BACK = ("Hey! Yeah all good, busy as always", "Hi {o}! so good to hear from you", "heyy 😊 I'm here",
              "Just got home, perfect timing", "Hello! what's up?", "Haha yes still alive, barely")
BYE = ("Gotta run, talk soon!", "Night! 😴", "ok dinner's ready, speak later", "Bye! say hi to {p} for me",
       "Let's catch up properly next week", "Talk soon x")
BYE_BACK = ("Bye!!", "Night night", "Will do, take care", "Yes let's! 👋", "Later!", "x")

SLOTS = {
    "day": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday", "the bank holiday"),
    "place": ("the market", "that new cafe on the corner", "the cinema", "the garden centre", "IKEA", "the beach",
              "the old town", "the farmers market", "the museum", "the park", "the pub quiz", "the laundrette"),
    "snack": ("dumplings", "falafel", "a cheese toastie", "churros", "sushi", "a massive burrito", "samosas",
              "pancakes", "a kebab", "bao buns", "croquetas", "fish and chips"),
    "thing": ("a lamp", "a rug", "a weird painting", "a second-hand bike", "some mugs", "a board game", "a hat",
              "a plant stand", "a mirror", "old postcards"),
    "chore": ("cleaning the oven", "sorting the wardrobe", "doing taxes", "fixing the shelf", "ironing",
              "defrosting the freezer", "washing the car", "sorting the recycling"),
    "feel": ("so tired", "weirdly productive", "a bit low", "really happy", "stressed", "lazy", "restless",
             "surprisingly calm"),
    "weather": ("raining sideways", "boiling hot", "freezing", "foggy all day", "so windy", "grey and drizzly",
                "gorgeous and sunny"),
    "kid": ("the kids", "my nephew", "the twins next door", "my little cousin"),
}
TOPICS = {
    "weather": ("It has rained {n} days in a row here, I've forgotten what the sun looks like",
                "It was {weather} here today, typical", "First snow of the year this morning! {kid} went crazy",
                "{weather} again, I've given up on the weather app",
                "Is it {weather} where you are too?"),
    "work": ("Work is chaos this week, {n} deadlines and a broken printer",
             "My manager scheduled a meeting at 5pm on a {day}. who does that",
             "had my review today, went better than I expected",
             "we have a new intern and he's lovely but asks a LOT of questions",
             "Back-to-back calls all day, my voice is gone", "Working from home today, still in pyjamas at {n}pm",
             "someone microwaved fish in the office kitchen again", "The office heating is broken, {weather} inside"),
    "food": ("I had the best {snack} of my life at {place}", "Tried a new recipe for dinner, total disaster 😂",
             "Why is cheese so expensive now", "we ordered pizza again, third time this week, no shame",
             "Made soup with whatever was left in the fridge, surprisingly decent",
             "Craving {snack} so badly right now", "Lunch was {snack} from {place}, no regrets"),
    "tv": ("Did you watch the final last night??", "I fell asleep ten minutes into the film again",
           "There's a new documentary about octopuses, you'd love it",
           "Can you recommend something to watch? I've run out of stuff", "the quiz show last night was so funny"),
    "family": ("{p} called me for an hour about {p2}'s birthday plans",
               "Mum is visiting this weekend, the flat needs a deep clean",
               "my dad finally learned how to send voice notes and now he sends ten a day",
               "{p} is getting married next year apparently! nobody tells me anything",
               "Babysat {kid} on {day}, I need a week to recover", "{p} and {p2} are fighting again, I'm staying out of it"),
    "weekend": ("Any plans for the weekend?", "We went to {place} on {day}, bought {thing} we don't need",
                "Lazy Sunday, didn't leave the sofa", "Spent the whole weekend {chore}, so boring",
                "went to a friend's barbecue, got sunburnt obviously", "Saturday was {place} then {snack}, perfect day",
                "I spent {day} {chore} and feel {feel}"),
    "health": ("I've got a cold again, third one this winter", "Went to the dentist, no fillings!! 🦷",
               "Trying to drink more water but I keep forgetting", "my back is killing me after the gym",
               "Slept {n} hours last night, I feel like a new person", "Feeling {feel} today, no idea why"),
    "news": ("Did you see the news about the bridge closing?", "Petrol prices are ridiculous right now",
             "They're finally building the new park down the road", "The trains were on strike again today",
             "There's a festival at {place} next month, want to go?", "Rent went up again, unbelievable"),
    "tech": ("My laptop died in the middle of a presentation 😩", "Why does every app need an update every day",
             "I accidentally deleted all my photos from 2019, then found a backup phew",
             "the wifi at home keeps dropping, calling the provider tomorrow",
             "Spent {n} minutes on hold with customer service today"),
}
REACT = ("Haha yes!", "Oh no, why?", "No way!", "Omg 😂", "Ugh, sorry", "That's amazing!!", "Wait really?",
         "hahaha classic", "Oh that sounds lovely", "Noooo", "So true", "I feel that", "😂😂", "Love that for you",
         "Oof", "Good for you!", "Same here honestly", "That's so annoying", "wow", "Nice one",
         "Hmm, not sure about that", "Of course you did 😄", "Sounds about right", "Aw that's sweet",
         "Tell {p} I said hi!", "Ha, {p} would love that", "Wait, what happened next?",
         "Yesss", "Can't believe it", "Oh wow!", "That's so you", "Hmm okay", "Proud of you!",
         "lmao", "Sending hugs", "Right?? exactly", "Ooh tell me more")
ASK_BACK = ("What about you?", "How's your week been?", "Any news on your side?", "How are things at work?",
            "How's {p} doing?", "Did you end up going?", "What are you up to tonight?", "How's the family?",
            "Are you still doing that early morning routine?", "Did you sort out the thing with the landlord?",
            "How was {place}?", "Are you feeling {feel} still?", "Did you ever get {thing} in the end?",
            "What did you do on {day}?", "Is {p} still staying with you?", "Did {kid} like the present?",
            "Still {chore} or done?", "How's the weather your side?")
ANSWER_BACK = ("Not much, same old", "Good! tired, but good", "Honestly a bit rubbish, but getting there",
               "Oh you know, surviving", "Yeah! it was fun, I'll tell you later", "{p} is fine, says hi",
               "Still waiting to hear back", "Quiet week for once, I'm enjoying it",
               "We'll see, depends on the weather", "Busy busy, but nothing exciting")
STORY = ("So you won't believe what happened.", "I was on my way to the shop,", "and then out of nowhere",
         "{p} turned up with a huge box", "it was raining sideways", "the bus driver just stopped and got out",
         "we laughed so hard people were staring", "by the time we got home it was almost midnight",
         "anyway I'm fine but what a day", "I still don't know what to think about it",
         "honestly it felt like a film", "and of course my phone died right then",
         "a stranger helped me carry everything", "we ended up having tea with the neighbours")
CAPTIONS = ("a dog on a beach", "a sunset over the harbour", "a cat asleep on a keyboard", "a messy desk with three mugs",
            "a plate of pasta", "a rainy street at night", "two people laughing at a table",
            "a child on a swing", "a bookshelf", "a city skyline from a plane window", "a birthday cake with candles",
            "a muddy pair of boots", "a snowy park", "a cup of coffee with latte art", "a handwritten note",
            "a garden with string lights")
EMOJI = ("😂", "😊", "🙈", "👍", "❤️", "🎉", "🙃", "😭", "✨", "🤔")


def fill(rng: random.Random, template: str, people: tuple[str, ...], other: str) -> str:
    p, p2 = rng.sample(people, 2) if len(people) > 1 else (people[0], people[0])
    slots = {k: rng.choice(v) for k, v in SLOTS.items() if "{" + k + "}" in template}
    return template.format(o=other, p=p, p2=p2, n=rng.randint(3, 9), **slots)


def noisy(rng: random.Random, text: str) -> str:
    """How people type: sometimes all lowercase without punctuation, sometimes an emoji."""
    r = rng.random()
    if r < 0.12:
        text = "".join(ch for ch in text.lower() if ch not in ".,!?")
    elif r < 0.22:
        text = f"{text} {rng.choice(EMOJI)}"
    return text


def story(rng: random.Random, people: tuple[str, ...], other: str) -> str:
    """A long, rambling turn of 4-8 pieces."""
    parts = [STORY[i] for i in sorted(rng.sample(range(len(STORY)), rng.randint(4, 8)))]
    return " ".join(fill(rng, p, people, other) for p in parts)


def exchange(rng: random.Random, people: tuple[str, ...], names: tuple[str, str],
             seen: set[str]) -> list[tuple[int, str]]:
    """One small-talk exchange as (speaker 0|1, text) pairs, opened by either speaker; an
    opener already in `seen` (this conversation's) is drawn again, a few times at most."""
    a = rng.randrange(2)
    b = 1 - a
    for _ in range(6):
        opener = fill(rng, rng.choice(TOPICS[rng.choice(list(TOPICS))]), people, names[b])
        if opener not in seen:
            break
    seen.add(opener)
    if rng.random() < 0.15:
        opener += f" [image: {rng.choice(CAPTIONS)}]"
    out = [(a, noisy(rng, opener)), (b, noisy(rng, fill(rng, rng.choice(REACT), people, names[a])))]
    r = rng.random()
    if r < 0.35:
        out += [(b, noisy(rng, fill(rng, rng.choice(ASK_BACK), people, names[a]))),
                (a, noisy(rng, fill(rng, rng.choice(ANSWER_BACK), people, names[b])))]
    elif r < 0.5:
        out += [(a, story(rng, people, names[b])), (b, noisy(rng, fill(rng, rng.choice(REACT), people, names[a])))]
    elif r < 0.65:
        out += [(b, noisy(rng, fill(rng, rng.choice(TOPICS[rng.choice(list(TOPICS))]), people, names[a])))]
    return out


def greeting(rng: random.Random, people: tuple[str, ...], names: tuple[str, str]) -> list[tuple[int, str]]:
    return [(0, fill(rng, rng.choice(GREET), people, names[1])), (1, fill(rng, rng.choice(GREET_BACK), people, names[0]))]


def farewell(rng: random.Random, people: tuple[str, ...], names: tuple[str, str]) -> list[tuple[int, str]]:
    a = rng.randrange(2)
    return [(a, fill(rng, rng.choice(BYE), people, names[1 - a])), (1 - a, rng.choice(BYE_BACK))]
