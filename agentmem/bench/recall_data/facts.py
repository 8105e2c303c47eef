"""What the conversations are about: the kinds of facts people mention in passing, each with
several ways of saying it (the evidence turn) and several ways of asking about it later.

Sayings are first person, in chat register, and name the concrete thing ("a second-hand
cello"); questions name the person and the abstract kind ("Which instrument did Priya pick
up?"), the way a person who remembers the gist asks. Slots: {v} the value, {when} a
relative time ("last Tuesday") resolved against the session's date, {x} an extra detail,
{name} the person asked about, {pos} their possessive pronoun, {other} the other speaker.
`distract` turns reuse a question's words without answering it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FactType:
    key: str
    values: tuple[str, ...]
    says: tuple[str, ...]
    asks: tuple[str, ...]
    when_asks: tuple[str, ...] = ()  # "When did {name} ...?": the fact is a dated event
    cues: tuple[str, ...] = ()  # the other speaker's turn that leads to it (no answer in it)
    distract: tuple[str, ...] = ()  # near misses: the question's words, not its answer
    extra: tuple[str, ...] = ()


def F(key, values, says, asks, when_asks=(), cues=(), distract=(), extra=()) -> FactType:  # noqa: N802
    return FactType(key, tuple(values), tuple(says), tuple(asks), tuple(when_asks), tuple(cues),
                    tuple(distract), tuple(extra))


FACTS: tuple[FactType, ...] = (
    F("instrument", ["cello", "ukulele", "saxophone", "violin", "drum kit", "harp", "banjo", "clarinet"],
      ["I finally bought a second-hand {v}, my neighbours are going to hate me 😅",
       "guess who's having {v} lessons now!! me. first one was {when}",
       "Been practising the {v} every evening this month, my fingers are so sore"],
      ["Which instrument did {name} pick up?", "What is {name} learning to play?",
       "What musical instrument has {name} started on?"],
      when_asks=["When did {name} start music lessons?"],
      cues=["So what's new with you?", "Anything exciting going on?"],
      distract=["{name}, did you ever pick up that instrument your uncle left you?",
                "Which instrument would you pick up if you had time to learn one?",
                "My cousin is learning to play something too but she won't tell me what lol"]),
    F("pet", ["tabby cat", "beagle", "parrot", "rabbit", "tortoise", "greyhound", "hamster", "corgi"],
      ["We adopted a {v} from the shelter {when}, we named it {x}",
       "Meet {x}, our new {v}!! [image: a {v} curled up on a blanket]",
       "{x} the {v} chewed through my charger again 🙄"],
      ["What pet does {name} have?", "What kind of animal lives with {name}?", "What animal did {name} adopt?"],
      when_asks=["When did {name} adopt an animal?"],
      cues=["How's the little monster?", "Any news since last time?"],
      distract=["Do you think {name} should have a pet? I keep saying a pet would be good for {obj}",
                "What kind of animal would you have if you could have any pet?"],
      extra=["Biscuit", "Miso", "Pepper", "Noodle", "Ziggy", "Mango", "Tofu", "Olive"]),
    F("city", ["Porto", "Leeds", "Osaka", "Nairobi", "Krakow", "Tampere", "Valencia", "Montreal", "Ghent"],
      ["We got the keys to the new flat in {v} {when}!!", "Finally settled in {v}, boxes everywhere haha",
       "the commute from {v} is so much shorter, best decision ever"],
      ["Where does {name} live now?", "Which city is {name} based in these days?",
       "What town did {name} relocate to?"],
      when_asks=["When did {name} move house?", "When did {name} relocate?"],
      cues=["How's the new place??", "Did the move go ok?"],
      distract=["I'd love to live in a city by the sea one day",
                "Where do you think {name} will end up living? {sub} changes {pos} mind every week"]),
    F("job", ["hospital pharmacy", "architecture firm", "bakery on Elm Street", "airline", "city library",
              "solar startup", "vet clinic", "primary school"],
      ["I start at the {v} on Monday, can't believe they picked me",
       "First week at the {v} done, everyone is lovely",
       "Signed the contract with the {v} {when} 🎉"],
      ["Where does {name} work?", "Who is {name}'s employer?", "Where did {name} get hired?"],
      when_asks=["When did {name} get the new job?", "When was {name} hired?"],
      cues=["Any news on the job hunt??", "So?? did you hear back?"],
      distract=["Where does {name} want to work after the course?", "My boss says nobody gets hired in winter",
                "Do you like where you work? honest answer"]),
    F("car", ["Volvo estate", "Fiat 500", "Tesla", "Skoda", "Mini", "camper van", "Vespa"],
      ["Sold the old banger and got a {v}!", "Picked up the {v} from the dealer {when}, it still smells new",
       "the {v} made a weird noise on the motorway, fingers crossed"],
      ["What does {name} drive now?", "Which vehicle did {name} buy?"],
      when_asks=["When did {name} buy a vehicle?"],
      cues=["Did you sort out the car situation?"],
      distract=["Do you still drive to work or take the bus?", "What car would you buy if money was no object?"]),
    F("allergy", ["peanuts", "shellfish", "cats", "pollen", "sesame", "penicillin", "kiwi"],
      ["Turns out I'm allergic to {v}, the doctor did the tests {when}",
       "Can't go near {v} anymore, my throat swells up",
       "ugh reacted to {v} again, the antihistamines make me so sleepy"],
      ["What is {name} allergic to?", "What does {name} have a bad reaction to?", "What must {name} avoid?"],
      when_asks=["When did {name} find out about the allergy?"],
      cues=["What did the doctor say in the end?"],
      distract=["Is {name} allergic to anything? asking for the party", "Allergies are the worst, my mum has loads"]),
    F("book", ["The Overstory", "Pachinko", "Dune", "Middlemarch", "Circe", "The Remains of the Day",
               "Klara and the Sun"],
      ["I'm halfway through {v}, can't put it down", "Just finished {v}, cried on the train lol",
       "{v} is sitting on my nightstand, ten pages a night"],
      ["What novel is {name} reading?", "Which book has {name} been into lately?"],
      cues=["Read anything good lately?"],
      distract=["Have you read any good books? I need a novel for the holiday",
                "{name} was reading something on the bus but I forgot what"]),
    F("show", ["Severance", "The Bear", "Succession", "Dark", "Fleabag", "Slow Horses", "Shogun"],
      ["Binged all of {v} this weekend, no regrets", "ok {v} season 2 is even better than the first",
       "we're three episodes into {v} and I'm hooked"],
      ["Which series has {name} been watching?", "What TV programme is {name} hooked on?"],
      cues=["Watching anything good at the moment?"],
      distract=["What series should I watch next? I've finished everything",
                "My brother is always watching some TV programme about cooking"]),
    F("hobby", ["pottery", "bouldering", "salsa", "knitting", "fencing", "birdwatching", "woodworking"],
      ["Joined a {v} club {when}, we meet on Thursdays", "my {v} teacher says I'm a natural 😂",
       "Tried {v} for the first time and now I'm obsessed [image: people at a {v} session]"],
      ["What new pastime did {name} take up?", "What activity does {name} do for fun now?",
       "Which hobby has {name} gotten into?"],
      when_asks=["When did {name} take up the new hobby?"],
      cues=["What have you been up to on Thursday nights? you're never free"],
      distract=["What do you do for fun these days? I need a hobby", "{name}'s new hobby? no idea, {sub} never said"]),
    F("garden", ["tomatoes", "basil", "chillies", "strawberries", "sunflowers", "courgettes"],
      ["My {v} finally came up! The balcony is basically a jungle",
       "[image: a pot of {v} on a sunny windowsill] look who's thriving",
       "Picked the first {v} this morning, so proud"],
      ["What is {name} growing?", "What plants does {name} grow at home?"],
      cues=["How's the balcony project going?"],
      distract=["I can't keep any plants alive, what are you even growing", "Mum wants us to grow our own veg this year"]),
    F("injury", ["wrist", "ankle", "collarbone", "two toes", "a finger"],
      ["Broke my {v} falling off the bike {when}, cast for six weeks",
       "x-ray came back, fractured {v} 🙄 so much for the summer",
       "typing with one hand, the {v} is still in plaster"],
      ["What injury did {name} suffer?", "How did {name} get hurt?", "What did {name} fracture?"],
      when_asks=["When did {name} get injured?", "When did {name}'s accident happen?"],
      cues=["Why weren't you at five-a-side??", "What happened to your arm in that photo?"],
      distract=["Did {name} ever get hurt at that climbing place? it looks dangerous",
                "My dad had a bad injury playing football years ago"]),
    F("language", ["Japanese", "Portuguese", "Korean", "Italian", "Swahili", "Dutch", "Greek"],
      ["Been doing {v} on Duolingo every morning, 200 day streak!",
       "my {v} tutor laughed at my accent today 😅", "Ordered dinner in {v} and the waiter understood me!!"],
      ["Which language is {name} studying?", "What language is {name} learning?"],
      distract=["I always wanted to learn a language but never stick with it",
                "Which language do you think is the hardest to study?"]),
    F("degree", ["nursing", "data science", "law", "marine biology", "architecture", "social work"],
      ["I got into the {v} master's programme!! starting in September",
       "Accepted!!! {v}, full time, I'm terrified", "the {v} course reading list is huge already"],
      ["What will {name} study at university?", "What subject did {name} get admitted for?"],
      cues=["Did you hear back from the universities??"],
      distract=["My niece wants to study at university abroad", "What did you study at university again?"]),
    F("concert", ["Arctic Monkeys", "Rosalía", "Coldplay", "Fela Kuti tribute band", "Björk", "Khruangbin"],
      ["Saw {v} live {when}, what a night",
       "[image: a crowded stage with purple lights] {v}!!! best night ever",
       "queued four hours but we were front row for {v}"],
      ["Which band did {name} see perform?", "Who did {name} watch on stage?"],
      when_asks=["When did {name} go to a gig?", "When was {name}'s concert?"],
      cues=["How was Saturday?!", "Where were you last night, you went quiet"],
      distract=["Which band would you most like to see perform live?", "{name}, are you going to see any bands this year?"]),
    F("gift", ["record player", "pasta machine", "kayak", "telescope", "espresso machine", "drone"],
      ["{x} got me a {v} for my birthday, I nearly cried", "Unwrapped a {v}!! best birthday present ever",
       "The {v} from {x} is already my favourite thing"],
      ["What present did {name} receive?", "What was {name} given as a gift?"],
      cues=["So what did you get for your birthday?"],
      distract=["What present should I get {name}? {pos} birthday is soon", "I'm terrible at gifts, I always get socks"],
      extra=["my sister", "my husband", "Mum", "my best mate", "Grandad"]),
    F("fear", ["spiders", "deep water", "flying", "heights", "clowns", "thunderstorms"],
      ["I'm terrified of {v}, always have been", "you know me and {v}, absolutely not 😱",
       "had a panic moment with {v} again, so embarrassing"],
      ["What scares {name}?", "What is {name} afraid of?", "What is {name}'s phobia?"],
      distract=["What are you afraid of? honestly", "{name} says nothing scares {obj} but I don't buy it"]),
    F("food", ["ramen", "jollof rice", "pierogi", "pho", "paella", "dal", "tacos al pastor"],
      ["Nothing beats a good bowl of {v} honestly", "I could eat {v} every single day",
       "found a place that does proper {v} near me, dangerous"],
      ["What dish does {name} like most?", "What is {name}'s favourite meal?"],
      distract=["What's your favourite meal to cook on a weekend?", "{name}'s favourite meal is probably whatever's free lol"]),
    F("paint", ["sage green", "terracotta", "navy blue", "mustard yellow", "dusty pink"],
      ["We painted the kitchen {v} {when}, what a job",
       "[image: a freshly painted {v} wall with tape still on] thoughts??", "the {v} walls look amazing in the evening light"],
      ["What colour did {name} choose for the kitchen?", "How did {name} redecorate?"],
      when_asks=["When did {name} redecorate?"],
      distract=["What colour should I choose for the bedroom? can't decide", "Did {name} ever redecorate that kitchen?"]),
    F("tattoo", ["swallow", "compass", "lotus", "tiny wave", "fern"],
      ["Got a small {v} tattooed on my ankle {when}!", "the {v} on my wrist finally healed, love it",
       "[image: a fine-line {v} on someone's forearm] it's done!!"],
      ["What ink did {name} get?", "What design did {name} have put on the skin?"],
      when_asks=["When did {name} get inked?"],
      distract=["Would you ever get ink done? I'd be too scared", "{name}'s brother wants a design on his skin, a dragon"]),
    F("diet", ["vegetarian", "vegan", "off sugar", "off coffee", "pescatarian"],
      ["Been {v} for three months now and I feel great", "day 30 of being {v}, still going strong",
       "I went {v} after that documentary, no going back"],
      ["What eating habit did {name} change?", "How has {name} altered meals?"],
      distract=["My eating habits are a mess since the new job", "Did {name} change anything about meals after the doctor?"]),
    F("team", ["Arsenal", "Boca Juniors", "the Lakers", "Celtic", "Ajax", "the Red Sox"],
      ["{v} won again!!! what a match", "can't talk, {v} are playing", "season ticket for {v} sorted for another year"],
      ["Which club does {name} support?", "Which side is {name} a fan of?"],
      cues=["Did you see the match?"],
      distract=["Which club do you think will win the league?", "{name} says {sub}'s not a fan of any side, liar"]),
    F("commute", ["cycle", "take the ferry", "walk", "get the tram", "carpool with a neighbour"],
      ["I {v} to work now, 25 minutes each way", "started to {v} in the mornings, way less stressful",
       "[image: a sunrise over the river] new routine, I {v} to work these days"],
      ["How does {name} get to the office?", "How does {name} travel to the job?"],
      distract=["How do you get to the office when it snows?", "The traffic to the office was a nightmare today"]),
    F("sport_event", ["half marathon", "10k trail race", "triathlon", "charity swim", "cycling sportive"],
      ["Ran my first {v} {when}, 2 hours 4 minutes!!", "[image: a finisher medal on a table] {v} done ✅",
       "legs still dead after the {v}"],
      ["What race did {name} complete?", "What endurance challenge has {name} finished?"],
      when_asks=["When did {name} complete the race?", "When was {name}'s endurance challenge?"],
      cues=["How did it go on Sunday??", "You survived?"],
      distract=["Are you doing any race this year? {name} keeps talking about it",
                "I could never finish an endurance challenge"]),
    F("phone", ["Pixel", "iPhone", "Fairphone", "flip phone", "Galaxy"],
      ["Dropped my old phone in the canal so I got a {v}", "the camera on the new {v} is mad",
       "finally switched to a {v}, still finding all the settings"],
      ["What mobile does {name} use now?", "Which handset did {name} buy?"],
      cues=["Why is your number different??"],
      distract=["Which mobile should I buy? mine is dying", "{name} never answers {pos} mobile anyway"]),
    F("volunteer", ["food bank", "animal shelter", "hospice", "community garden", "youth football club"],
      ["Spent Saturday at the {v} again, sorting tins all day", "I help out at the {v} twice a month now",
       "the {v} needs more hands, you should come"],
      ["Where does {name} do unpaid work?", "Which cause does {name} give time to?"],
      distract=["I'd like to do unpaid work somewhere but I'm so busy", "{name} gives {pos} time to everyone, it's too much"]),
    F("baking", ["sourdough", "croissants", "bagels", "focaccia", "cinnamon buns"],
      ["My {v} actually rose this time!! [image: a golden loaf on a cooling rack]",
       "up at 6 to shape the {v}, I've become that person", "third batch of {v} this week, the neighbours love me"],
      ["What has {name} been baking?", "What does {name} make in the oven?"],
      distract=["Is {name} still baking? {sub} went quiet about it", "What should I make in the oven for the party?"]),
    F("house_plant", ["monstera", "fiddle leaf fig", "bonsai", "orchid", "cactus collection"],
      ["My {v} has a new leaf!! [image: a {v} by a window]", "bought a {v} to cheer up the flat",
       "I talk to the {v} every morning, don't judge"],
      ["What indoor greenery does {name} look after?", "What does {name} keep on the windowsill?"],
      distract=["My indoor greenery all died over winter", "What should I keep on the windowsill, something easy?"]),
    F("wedding", ["Lake Como", "a barn in Devon", "the botanical gardens", "Santorini", "the town hall"],
      ["We booked {v} for the wedding!!", "the venue is {v}, save the date 💍",
       "went to see {v} {when} and it was perfect for the big day"],
      ["Where is {name} getting married?", "What venue did {name} pick for the ceremony?"],
      when_asks=["When did {name} book the ceremony venue?"],
      cues=["Any luck with the planning?", "Did you two decide on a place?"],
      distract=["Where did your parents get married? mine eloped", "{name}, have you picked a venue yet or not"]),
    F("course", ["first aid", "sign language", "photography", "coding bootcamp", "sommelier"],
      ["Passed my {v} certificate {when}!!", "the {v} class is every Wednesday night",
       "[image: a certificate that says {v}] done it"],
      ["What training did {name} complete?", "What qualification did {name} earn?"],
      when_asks=["When did {name} earn the qualification?"],
      cues=["How did the exam go?"],
      distract=["Is that training {name} did worth it?", "I need a qualification for the new role, ugh"]),
    F("sleep", ["insomnia", "sleep apnea", "night terrors"],
      ["The doctor thinks it's {v}, I'm up at 3 every night", "{v} is back, I had about 4 hours",
       "new mattress, still {v}, I'm a zombie"],
      ["What health problem keeps {name} awake?", "Why is {name} tired all the time?"],
      cues=["You look exhausted, are you ok?"],
      distract=["I'm tired all the time too, must be the weather", "What keeps you awake at night? for me it's the neighbours"]),
    F("collect", ["vinyl records", "stamps", "vintage cameras", "Lego sets", "fountain pens"],
      ["Found two more {v} at the flea market, the collection grows", "I counted my {v}: 212 😳",
       "[image: shelves full of {v}] the shelf is full again"],
      ["What does {name} collect?", "What does {name} hoard as a collector?"],
      distract=["My dad collects everything, the garage is a museum", "Does {name} still hoard stuff as a collector?"]),
)

# People the speakers talk about: a relation and a fact of theirs.
RELATIONS = ("sister", "brother", "cousin", "best friend", "coworker", "neighbour", "flatmate", "aunt")
THIRD_JOBS = ("nurse", "pilot", "plumber", "dentist", "chef", "teacher", "lawyer", "firefighter", "barista",
              "electrician")
THIRD_SAYS = ("My {rel} {p} just started as a {v}, so proud of {obj}",
              "{p} (my {rel}) is working as a {v} now, crazy hours",
              "had dinner with {p} yesterday, {sub}'s a {v} these days and loves it")
THIRD_ASKS = ("What does {p} do for a living?", "What is {p}'s job?", "What is {p}'s profession?")


@dataclass(frozen=True)
class Chain:
    """Two facts about one person in two sessions; the question needs both turns."""

    key: str
    values: tuple[str, ...]
    first: tuple[str, ...]  # {v}: the first value
    second: tuple[str, ...]  # {v}: the second value, {u}: the first
    asks: tuple[str, ...]  # {v}, {u} may appear
    answer: str = "{u}, then {v}"
    extra: tuple[str, ...] = field(default=())


CHAINS: tuple[Chain, ...] = (
    Chain("moves", ("Lisbon", "Bristol", "Kyoto", "Accra", "Gdansk", "Bilbao", "Quebec", "Utrecht"),
          ("We're all moved in, {v} here we come!", "The flat in {v} has the tiniest kitchen but I love it"),
          ("Plot twist: we're leaving {u}, moving to {v} for my partner's job",
           "Unpacking again 😩 {v} this time, hopefully for good"),
          ("Which two cities has {name} lived in during our chats?", "Where did {name} live before and after moving?")),
    Chain("quit_next", ("pottery course", "cooking school", "bike tour of Vietnam", "woodwork apprenticeship",
                        "sailing trip"),
          ("I handed in my notice today. Done with that place.", "It's official, I quit! no more spreadsheets"),
          ("Started the {v} this week and I'm loving it", "Week one of the {v} done, best decision I've made"),
          ("What did {name} do right after leaving the old job?", "What came next for {name} after resigning?"),
          answer="quit the job, then {v}"),
    Chain("pets", ("kitten", "puppy", "budgie", "guinea pig", "ferret", "goldfish"),
          ("We brought home a {v} {when}! chaos already", "[image: a tiny {v} in a cardboard box] new family member"),
          ("the {u} has a friend now, we adopted a {v} 😅", "Plot twist: a {v} joined the {u}, house is a zoo"),
          ("Which animals has {name} adopted?", "What pets did {name} get over time?")),
    Chain("hobbies", ("rock climbing", "tennis", "rowing", "yoga", "kickboxing", "swimming"),
          ("Tried {v} for the first time, everything hurts", "signed up for {v} at the leisure centre"),
          ("Gave up on {u}, doing {v} now and I actually like it", "{v} > {u}, I've switched"),
          ("Which two sports has {name} tried?", "What exercise did {name} do before the current one?")),
    Chain("niece", ("Amara", "Sofia", "Leila", "Noor", "Ines", "Maya"),
          ("My sister {x} is pregnant!! so much news this year", "Big news: my sister {x} is expecting, due in spring"),
          ("{x} had the baby!!! a little girl, {v}", "[image: a newborn in a yellow blanket] {x}'s girl {v} ❤️"),
          ("What is the name of {name}'s niece?", "What is {name}'s sister's daughter called?"),
          answer="{v}", extra=("Hana", "Clara", "Zeynep", "Abena", "Marta", "Yuki")),
)

# Things done again and again in different months: "What did X cook in March 2023?"
RECURRING: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    # key: (values, says with {v}, asks with {name} and {month})
    "cook": (("lasagne", "green curry", "shakshuka", "mushroom risotto", "beef stew", "paella", "dumplings",
              "moussaka"),
             ("Made {v} from scratch tonight, the whole flat smells amazing",
              "[image: a pot of {v} on the stove] attempt number one", "my {v} turned out pretty good for once"),
             ("What did {name} cook in {month}?", "Which dish did {name} make in {month}?")),
    "hike": (("Ben Nevis", "the Pico do Arieiro trail", "Snowdon", "Mount Rigi", "the Lion's Head trail",
              "the Devil's Staircase"),
             ("We climbed {v} today, the view at the top!! [image: hikers at a summit cairn]",
              "did {v}, 6 hours, knees destroyed", "{v} was foggy but so worth it"),
             ("Which mountain did {name} hike in {month}?", "Where did {name} go walking in {month}?")),
    "film": (("Past Lives", "Oppenheimer", "Dune Part Two", "Perfect Days", "Anatomy of a Fall", "Barbie"),
             ("Saw {v} at the cinema, still thinking about it", "{v} was sooo long but I loved it",
              "we went to {v} last night, popcorn was stale lol"),
             ("Which movie did {name} see in {month}?", "What did {name} watch at the pictures in {month}?")),
}

# "What did X do the week after the trip to Y?"
TRIP_SAYS = ("Just back from {c}! The food was unreal", "Landed from {c} an hour ago, so tired but happy",
             "[image: a busy market street in {c}] back home now, miss it already")
TRIP_CITIES = ("Lisbon", "Marrakech", "Hanoi", "Oaxaca", "Tbilisi", "Seville", "Istanbul", "Reykjavik")
AFTER_VALUES = ("painted the garden fence", "started a pottery class", "went to a job interview",
                "helped a friend move house", "ran a 5k", "visited grandma in hospital")
AFTER_SAYS = ("This weekend I {v}, exhausting", "Yesterday I {v}, long story", "Spent Saturday, I {v}")
AFTER_ASKS = ("What did {name} do the week after {pos} trip to {c}?",
              "What happened with {name} in the days after getting back from {c}?")
