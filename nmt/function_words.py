"""Function words of Spanish and English: what is not a content word in content-word
alignment scores (``nmt eval --align`` with the texts) and in the demo corpus's reference
alignment (scripts/build_corpus.py).

Why content words: in the Strong's-number tagging behind the demo corpus's reference
alignment, articles, prepositions, conjunctions, pronouns and auxiliaries often carry the
number of the word next to them ("In" tagged as "God"; "EN el principio" as one phrase for
"beginning"), so their reference links are unreliable, while nouns, verbs, adjectives, adverbs,
names and numerals are tagged one by one. A token is a content word unless it is only
punctuation or, lower-cased and stripped of punctuation at both ends, is in its language's
closed list below (the 1909 Spanish spelling included: "á", "ó", "é", "fué").

Plain Python with no imports, so that any script can use it.
"""

from __future__ import annotations

_SPANISH = """
el la lo los las un una uno unos unas al del
a á ante bajo cabe con contra de desde durante en entre hacia hasta mediante para por
según segun sin so sobre tras
y e é o ó u ú ni pero mas sino que si porque pues como cuando aunque mientras donde
yo tú tu él ella ello nosotros nosotras vosotros vosotras ellos ellas usted ustedes
me te se nos os le les mí mi mis ti tus sí su sus conmigo contigo consigo
nuestro nuestra nuestros nuestras vuestro vuestra vuestros vuestras
este esta esto estos estas ese esa eso esos esas aquel aquella aquello aquellos aquellas
quien quienes cual cuales cuyo cuya cuyos cuyas
ha han he has hemos habéis habeis había habían habia habian hubo hubieron haber habiendo
es son era eran fué fue fueron ser sido siendo sea sean será serán sera seran soy eres
somos sois fuí fui fuiste fuimos seré seras
está están esta estan estaba estaban estar estado estando estoy estás estamos esté estén
"""

_ENGLISH = """
a an the
of in to for with on at by from into upon unto onto over under about against among
before after through throughout out up down off above below between within without
toward towards until till beside besides across along around behind beyond near
and or but nor if that as so than because though although while when whenever then
yet either neither whether whereas where wherever
i me my mine you your yours he him his she her hers it its we us our ours they them
their theirs thee thou thy thine ye myself yourself himself herself itself ourselves
yourselves themselves this these those who whom whose which what whoever whatever
is are was were be been being am art have has had having hath do does did doth
will would shall should may might can could must let
"""

FUNCTION_WORDS: dict[str, frozenset[str]] = {
    "es": frozenset(_SPANISH.split()),
    "en": frozenset(_ENGLISH.split()),
}


def _bare(token: str) -> str:
    """Lower-cased, without punctuation at either end ("Dios:" -> "dios", "(y" -> "y")."""
    start, end = 0, len(token)
    while start < end and not token[start].isalnum():
        start += 1
    while end > start and not token[end - 1].isalnum():
        end -= 1
    return token[start:end].lower()


def is_content_word(token: str, language: str) -> bool:
    """Whether a whitespace token is a content word of ``language`` ("es" or "en")."""
    bare = _bare(token)
    return bool(bare) and bare not in FUNCTION_WORDS[language]


def content_mask(tokens: list[str], language: str) -> list[bool]:
    return [is_content_word(token, language) for token in tokens]
