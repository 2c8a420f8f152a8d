"""Write single_fact.jsonl: single-fact questions over passages of the 2WikiMultihopQA corpus.

Each item holds three passages of the same kind (films, villages, people, rivers, mountains, albums,
queens): one states the answer, two are plausible distractors. The answer passage's position rotates
(first, second, third). Passages are copied from the corpus; those over 100 tokens are cut at a sentence
end after the fact the question asks about. Usage: python make_single_fact.py CORPUS.json OUT.jsonl
"""

import json
import sys

ITEMS = [  # (question, gold answers, answer passage title, distractor titles)
    ("Who directed the film Buckaroo from Powder River?", ["Ray Nazarro"],
     "Buckaroo from Powder River", ["The Wild Frontier (film)", "The Fighting Vigilantes"]),
    ("Which studio released the film Range War?", ["Paramount Pictures", "Paramount"],
     "Range War", ["Outlaw Express", "Stagecoach Express (film)"]),
    ("What was the population of Gohar at the 2006 census?", ["85"],
     "Gohar, Iran", ["Khosrow, Andika", "Dameh"]),
    ("Who directed the film Robin Hood of the Range?", ["William Berke"],
     "Robin Hood of the Range", ["Robin Hood of Texas", "Texans Never Cry"]),
    ("Where was Stephen Warbeck born?", ["Southampton", "Southampton, Hampshire"],
     "Stephen Warbeck", ["John Middleton (footballer, born 1955)", "George Pearson (filmmaker)"]),
    ("In which department of Bolivia is the mountain Allqamari?", ["Chuquisaca Department", "Chuquisaca"],
     "Allqamari", ["Wisk'achani (Oruro)", "Inka P'iqi"]),
    ("Into which river does the Smagne flow?", ["the Lay", "Lay"],
     "Smagne", ["Rio Verde (Mato Grosso do Sul)", "Slava (river)"]),
    ("Who directed the film Spring Handicap?", ["Herbert Brenon"],
     "Spring Handicap", ["The Last Coupon", "Inside the Room"]),
    ("Which record label released the album Marching for Liberty?", ["Noise Art Records", "Noise Art"],
     "Marching for Liberty", ["Your Songs", "The Magical Sounds of Banco de Gaia"]),
    ("In which city was Diane Kurys born?", ["Lyon"],
     "Diane Kurys", ["Oskar Roehler", "Charles Lamont"]),
    ("In which year was the film Tall Man Riding released?", ["1955"],
     "Tall Man Riding", ["Showdown at Boot Hill", "Billy the Kid's Range War"]),
    ("Who directed the film My Little Eye?", ["Marc Evans"],
     "My Little Eye", ["It's a Wonderful Afterlife", "The Return of Bulldog Drummond"]),
    ("What was the population of Marufabad at the 2006 census?", ["545"],
     "Marufabad", ["Qaleh-ye Sahar", "Qaleh-ye Nashin Shahi"]),
    ("In which town was Olav Aaraas born?", ["Fredrikstad"],
     "Olav Aaraas", ["Albert III, Duke of Bavaria", "Xu Deshuai"]),
    ("In which country is the village Sobotište?", ["Slovakia"],
     "Sobotište", ["Ampelakia, Evros", "Radisele"]),
    ("Who directed the film Gladiators Seven?", ["Alberto De Martino"],
     "Gladiators Seven", ["Once You're Born You Can No Longer Hide",
                          "The Blue Collar Worker and the Hairdresser in a Whirl of Sex and Politics"]),
    ("Which company released the film Raiders of Red Gap?", ["Producers Releasing Corporation"],
     "Raiders of Red Gap", ["Bury Me Not on the Lone Prairie (film)", "Robin Hood of Texas"]),
    ("In which region of Peru is the mountain Uchuy Milla?", ["Cusco Region", "Cusco"],
     "Uchuy Milla", ["Wiqu (Lima)", "Machu Kunturi"]),
    ("Whose debut studio album is Love & War?", ["Daniel Merriweather"],
     "Love & War (Daniel Merriweather album)", ["The Love & War MasterPeace", "Sgt. Disco"]),
    ("Who directed the film Mord Em'ly?", ["George Pearson"],
     "Mord Em'ly", ["A Romance of Seville", "House of Blackmail"]),
    ("Of which country was Euphemia of Rügen the queen consort?", ["Norway"],
     "Euphemia of Rügen", ["Edith of Wessex", "Sālote Lupepauʻu"]),
    ("The Pleasure Garden (1925) is based on a novel by whom?", ["Oliver Sandys"],
     "The Pleasure Garden (1925 film)", ["The Black Marble", "The Adventurer of Tortuga"]),
]


def shorten(text: str, max_words: int = 70) -> str:
    """Cut ``text`` after the last sentence end within ``max_words`` words (the first sentence at least)."""
    words = text.split()
    if len(words) <= max_words:
        return text
    cut = " ".join(words[:max_words])
    end = max(cut.rfind(". "), cut.rfind(".\""), cut.rfind(".)"))
    return cut[: end + 1] if end > 0 else cut


def main(corpus_path: str, out_path: str) -> None:
    corpus = {p["title"]: p["text"] for p in json.load(open(corpus_path, encoding="utf-8"))}
    with open(out_path, "w", encoding="utf-8") as out:
        for i, (question, answers, title, distractors) in enumerate(ITEMS):
            ctxs = [{"title": t, "text": shorten(corpus[t])} for t in distractors]
            ctxs.insert(i % 3, {"title": title, "text": shorten(corpus[title])})
            assert any(a in ctxs[i % 3]["text"] for a in answers), (title, answers)
            out.write(json.dumps({"id": f"sf{i + 1:02d}", "question": question, "answers": answers,
                                  "ctxs": ctxs}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
