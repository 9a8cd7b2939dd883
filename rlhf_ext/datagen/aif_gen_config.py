"""AIF-Gen's task configs, mapped onto rlhf-ext's :class:`~rlhf_ext.datagen.schema.DatagenConfig` (paper 000,
AIF-GEN; the reference implementation is github.com/amgadelgamal/AIF-Gen; datasets: :mod:`rlhf_ext.datagen.aif_gen`).

**Task config** (what ``aif generate CONFIG MODEL`` reads; model, temperature and token limits come from the command
line)::

    task_specs:
      - num_samples: 10000
        alignment_task:
          objective: "Ask a non-trivial math ... question."
          preference: "Explain the answer ... understood by a five year old."
          domain:
            education:               # no value: the built-in education vocabulary
            physics:
              seed_words: [quantum, optics, relativity]
              weight: 0.5            # on every component or on none (then 1/n each)
              description: optional  # accepted and ignored

:func:`config_to_rlhf_ext` maps ``task_specs[i]`` to ``tasks[i]`` named ``task<i>-<component names>``, one
``piecewise`` stage per task, rlhf-ext's default ``test_ratio``. A component without ``seed_words`` (or with
``seed_words: <name>``) names a built-in vocabulary (:data:`VOCABULARIES`, about 95 words each); repeated seed words
are kept once. Top-level ``model`` / ``max_concurrency`` (AIF-Gen's saved ``config.json``) set the ``generation``
keys; the rlhf-ext sections ``name``, ``seed``, ``drift``, ``generation`` and ``output`` pass through.

The offline backend's phrase-bank style is the bank's style the preference selects, else the derived
``pref:<slug>`` (:func:`rlhf_ext.datagen.phrasebank.preference_style_name`); its objective kind is the one the texts
select, else :data:`DEFAULT_OBJECTIVE_KIND`, so every AIF-Gen config generates offline. ``style:`` and
``objective_kind:`` inside ``alignment_task`` (rlhf-ext additions) choose them explicitly.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Literal

from rlhf_ext.config import RecipeError

if TYPE_CHECKING:
    from rlhf_ext.datagen.phrasebank import PhraseBank

CONFIG_FORMATS: tuple[str, ...] = ("auto", "aif-gen", "rlhf-ext")
#: Top-level keys of AIF-Gen's saved ``config.json`` besides ``task_specs``: set the same rlhf-ext ``generation`` key.
_GENERATION_KEYS = ("model", "max_concurrency")
#: rlhf-ext sections that may sit beside ``task_specs`` and pass through unchanged.
_PASS_THROUGH_KEYS = ("name", "seed", "drift", "generation", "output")
_SPEC_KEYS = ("num_samples", "alignment_task")
_TASK_KEYS = ("objective", "preference", "domain")
_TASK_EXTRA_KEYS = ("style", "objective_kind")
_COMPONENT_KEYS = ("seed_words", "weight", "description", "name")
#: The offline objective kind of an AIF-Gen task whose objective and preference texts select none (free-form text).
DEFAULT_OBJECTIVE_KIND = "generation"


def _vocabulary(text: str) -> tuple[str, ...]:
    """Comma-separated words of a vocabulary block, in order."""
    return tuple(w.strip() for w in text.replace("\n", " ").split(",") if w.strip())


EDUCATION_SEED_WORDS = _vocabulary("""
    lesson plan, syllabus, lecture hall, tutoring, homework, grading rubric, semester, kindergarten, high school,
    university, community college, vocational training, apprenticeship, literacy, numeracy, phonics, algebra,
    geometry, calculus, statistics, chemistry lab, physics, biology, history, geography, civics, economics,
    philosophy, literature, essay writing, grammar, vocabulary, spelling bee, reading comprehension, science fair,
    field trip, school library, textbook, worksheet, flashcards, quiz, midterm exam, final exam, standardized test,
    report card, transcript, diploma, bachelor's degree, master's thesis, doctoral dissertation, scholarship,
    tuition, student loan, enrollment, admissions, campus, dormitory, cafeteria, recess, principal, teacher,
    professor, teaching assistant, school counselor, classmate, study group, peer tutoring, online course,
    distance learning, blended learning, flipped classroom, project-based learning, special education,
    gifted program, early childhood, lifelong learning, adult education, critical thinking, problem solving,
    memorization, note taking, attention span, learning disability, bilingual education, curriculum reform,
    school board, accreditation, graduation ceremony, extracurricular, debate club, homeroom, office hours,
    lab report, pop quiz, group project, educational psychology
    """)

FINANCE_SEED_WORDS = _vocabulary("""
    stock market, bond yield, interest rate, inflation, central bank, monetary policy, fiscal deficit, mortgage,
    credit score, savings account, checking account, compound interest, dividend, portfolio, diversification,
    index fund, mutual fund, exchange-traded fund, hedge fund, venture capital, private equity,
    initial public offering, market capitalization, price-earnings ratio, balance sheet, income statement,
    cash flow, depreciation, amortization, audit, tax return, capital gains, retirement plan, pension, annuity,
    life insurance, premium, deductible, budget, household debt, credit card, overdraft, loan default, bankruptcy,
    foreclosure, collateral, leverage, margin call, short selling, options contract, futures, derivatives,
    commodity, foreign exchange, currency peg, exchange rate, cryptocurrency, blockchain ledger, stablecoin,
    fintech, mobile payments, wire transfer, remittance, microfinance, liquidity, solvency, risk management,
    credit rating, treasury bill, yield curve, recession, bull market, bear market, volatility, arbitrage,
    asset allocation, wealth management, financial advisor, brokerage, stock exchange, quarterly earnings, revenue,
    profit margin, operating expenses, working capital, valuation, merger, acquisition, shareholder, bondholder,
    regulation, anti-money laundering, consumer protection, emergency fund, net worth, passive income
    """)

HEALTHCARE_SEED_WORDS = _vocabulary("""
    primary care, emergency room, intensive care unit, nurse practitioner, surgeon, pediatrician, cardiologist,
    oncologist, radiology, diagnosis, prognosis, symptom, chronic illness, infection, antibiotic resistance,
    vaccination, immunity, epidemic, public health, hygiene, nutrition, obesity, diabetes, hypertension,
    cholesterol, heart disease, stroke, cancer screening, chemotherapy, physical therapy, rehabilitation,
    mental health, anxiety, depression, psychotherapy, sleep apnea, insomnia, pain management, anesthesia,
    outpatient clinic, hospital ward, medical record, telemedicine, health insurance, prescription, pharmacist,
    dosage, side effect, clinical trial, placebo, genetics, blood pressure, blood test, x-ray, MRI scan,
    ultrasound, allergy, asthma, arthritis, osteoporosis, dementia, Alzheimer's disease, pregnancy, prenatal care,
    midwife, neonatal, vaccine schedule, first aid, CPR, paramedic, ambulance, triage, hand washing, dental care,
    eyesight, hearing loss, dermatology, wound care, organ transplant, dialysis, kidney function, liver, lungs,
    immune system, inflammation, metabolism, hydration, exercise, wellness, preventive care, caregiver, hospice,
    palliative care, patient safety, informed consent, medical ethics
    """)

POLITICS_SEED_WORDS = _vocabulary("""
    election, ballot, voter turnout, campaign, candidate, political party, coalition government, parliament,
    congress, senate, house of representatives, legislation, bill, veto, constitution, amendment, supreme court,
    judicial review, separation of powers, checks and balances, federalism, local government, mayor, governor,
    president, prime minister, cabinet, minister, opposition, lobbying, interest group, campaign finance, polling,
    swing state, gerrymandering, redistricting, referendum, direct democracy, representative democracy,
    authoritarianism, civil liberties, human rights, freedom of speech, press freedom, protest, civil disobedience,
    social movement, grassroots organizing, populism, nationalism, liberalism, conservatism, socialism,
    libertarianism, ideology, partisanship, polarization, bipartisan, filibuster, impeachment, executive order,
    foreign policy, diplomacy, treaty, sanctions, trade agreement, tariff, immigration policy, border control,
    asylum, welfare state, tax reform, public spending, budget deficit, healthcare policy, climate policy,
    electoral college, proportional representation, term limits, incumbent, debate, political scandal, corruption,
    transparency, accountability, bureaucracy, public opinion, propaganda, misinformation, town hall, petition,
    civic duty, citizenship, sovereignty, geopolitics, united nations
    """)

TECHNOLOGY_SEED_WORDS = _vocabulary("""
    software, hardware, algorithm, data structure, programming language, compiler, operating system,
    cloud computing, data center, server, database, encryption, cybersecurity, firewall, malware, phishing,
    password manager, two-factor authentication, artificial intelligence, machine learning, neural network,
    deep learning, natural language processing, computer vision, robotics, automation, internet of things,
    smart home, wearable device, smartphone, tablet, laptop, microchip, semiconductor, transistor,
    quantum computing, supercomputer, bandwidth, fiber optics, wireless network, 5G, Wi-Fi router,
    satellite internet, search engine, social media, streaming service, e-commerce, mobile app, user interface,
    user experience, open source, version control, debugging, unit testing, agile development, startup,
    venture funding, big data, data analytics, data privacy, blockchain, virtual reality, augmented reality,
    3D printing, electric vehicle, battery technology, solar panel, self-driving car, drone, GPS navigation,
    digital camera, video game, game engine, chatbot, voice assistant, recommendation system, API, microservices,
    containers, virtual machine, edge computing, latency, web browser, HTML, JavaScript, Python, Linux, keyboard,
    touchscreen, memory chip, solid-state drive, graphics card, tech support, digital literacy, e-waste
    """)

#: Built-in seed vocabularies by name (what ``domain: {education: }`` means).
VOCABULARIES: dict[str, tuple[str, ...]] = {
    "education": EDUCATION_SEED_WORDS,
    "finance": FINANCE_SEED_WORDS,
    "healthcare": HEALTHCARE_SEED_WORDS,
    "politics": POLITICS_SEED_WORDS,
    "technology": TECHNOLOGY_SEED_WORDS,
}


# ------------------------------------------------------------------------------------------------------ configs
def _mapping(value: Any, where: str, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RecipeError(f"{where}: expected {what}, got {type(value).__name__} {value!r}")
    return value


def _check_keys(value: dict[str, Any], where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    valid = ", ".join(sorted(required + optional))
    for key in value:
        if key not in required + optional:
            raise RecipeError(f"{where}: unknown key {key!r}; valid keys here: {valid}")
    for key in required:
        if key not in value:
            raise RecipeError(f"{where}: missing key {key!r}")


def _component_words(name: str, value: dict[str, Any], where: str) -> list[str]:
    """A component's seed words: its list (repeats kept once), or the built-in vocabulary its ``seed_words`` string or
    its name names."""
    words = value.get("seed_words", name)
    if isinstance(words, str):
        try:
            return list(VOCABULARIES[words])
        except KeyError:
            how = "has no seed_words" if "seed_words" not in value else f"has seed_words {words!r}"
            raise RecipeError(
                f"{where}: the component {how} and {words!r} is not a built-in vocabulary "
                f"({', '.join(VOCABULARIES)}); list its words: seed_words: [word, ...]"
            ) from None
    if not isinstance(words, list):
        raise RecipeError(f"{where}.seed_words: expected a list of words or a vocabulary name, got {words!r}")
    return list(dict.fromkeys(str(w) for w in words if w is not None and str(w).strip()))


def _domain_to_rlhf_ext(domain: Any, where: str) -> dict[str, dict[str, Any]]:
    """AIF-Gen's ``domain`` mapping as rlhf-ext's (``{name: {seed_words, weight}}``), weights as AIF-Gen sets them."""
    domain = _mapping(domain, where, "a mapping of component names, e.g. {education: } or {physics: {seed_words: []}}")
    if not domain:
        raise RecipeError(f"{where}: a domain needs at least one component")
    out: dict[str, dict[str, Any]] = {}
    weighted = []
    for name, value in domain.items():
        cwhere = f"{where}.{name}"
        value = _mapping({} if value is None else value, cwhere, "seed_words/weight/description or no value")
        _check_keys(value, cwhere, (), _COMPONENT_KEYS)
        words = _component_words(str(name), value, cwhere)
        if not words:
            raise RecipeError(f"{cwhere}.seed_words: must contain at least one word")
        out[str(name)] = {"seed_words": words}
        if "weight" in value:
            weighted.append(str(name))
            out[str(name)]["weight"] = value["weight"]
    if weighted and len(weighted) != len(out):
        missing = [n for n in out if n not in weighted]
        raise RecipeError(
            f"{where}: weight is given for {', '.join(weighted)} but not for {', '.join(missing)}; give every "
            "component a weight or none (uniform)"
        )
    if not weighted:  # AIF-Gen's Domain: uniform weights 1/n
        for comp in out.values():
            comp["weight"] = 1.0 / len(out)
    return out


def preference_style(preference: str, bank: PhraseBank | None = None) -> str:
    """The offline phrase-bank style of an AIF-Gen preference: the packaged bank's style when its triggers select
    exactly one, else the derived style ``pref:<slug>``; ``ValueError`` when the preference has no word."""
    from rlhf_ext.datagen.phrasebank import load_phrase_bank, preference_style_name

    bank = bank if bank is not None else load_phrase_bank()
    try:
        style = bank.infer_style(preference)
    except ValueError:  # several styles match: the derived style keeps the preference's own wording
        style = None
    return style or preference_style_name(preference)


def _task_to_rlhf_ext(index: int, spec: Any, bank: PhraseBank | None) -> dict[str, Any]:
    where = f"task_specs[{index}]"
    spec = _mapping(spec, where, "a mapping with num_samples and alignment_task")
    _check_keys(spec, where, _SPEC_KEYS)
    task = _mapping(spec["alignment_task"], f"{where}.alignment_task", "a mapping with objective, preference, domain")
    _check_keys(task, f"{where}.alignment_task", _TASK_KEYS, _TASK_EXTRA_KEYS)
    for key in ("objective", "preference"):
        if not isinstance(task[key], str) or not task[key].strip():
            raise RecipeError(f"{where}.alignment_task.{key}: expected non-empty text, got {task[key]!r}")
    domain = _domain_to_rlhf_ext(task["domain"], f"{where}.alignment_task.domain")
    from rlhf_ext.datagen.phrasebank import load_phrase_bank

    bank = bank if bank is not None else load_phrase_bank()
    try:
        style = task.get("style") or preference_style(task["preference"], bank)
    except ValueError as e:
        raise RecipeError(f"{where}.alignment_task.preference: {e}; add style: NAME to the alignment_task") from None
    kind = task.get("objective_kind")
    if kind is not None and kind not in bank.objectives:
        raise RecipeError(
            f"{where}.alignment_task.objective_kind: unknown kind {kind!r}; choose one of {', '.join(bank.objectives)}"
        )
    out = {
        "name": f"task{index}-" + "-".join(domain),
        "objective": task["objective"],
        "preference": task["preference"],
        "domain": domain,
        "num_samples": spec["num_samples"],
        "style": style,
    }
    if kind is None and bank.infer_objective_kind(task["objective"], task["preference"]) is None:
        kind = DEFAULT_OBJECTIVE_KIND  # (an inferable kind is left to resolve_tasks, as before: same fingerprints)
    if kind is not None:
        out["objective_kind"] = kind
    return out


def config_to_rlhf_ext(data: dict[str, Any], name: str = "aif-gen", bank: PhraseBank | None = None) -> dict[str, Any]:
    """An AIF-Gen task config (loaded YAML) as an rlhf-ext config mapping (see the module docstring); the result is
    validated by :func:`rlhf_ext.datagen.schema.load_task_config`. Errors are ``RecipeError`` naming the key path.
    """
    if detect_config_format(data) != "aif-gen":
        keys = ", ".join(sorted(map(str, data))) if isinstance(data, dict) else type(data).__name__
        raise RecipeError(f"not an AIF-Gen task config: it has no task_specs (it has: {keys or 'nothing'})")
    _check_keys(data, "AIF-Gen config", ("task_specs",), _GENERATION_KEYS + _PASS_THROUGH_KEYS)
    specs = data["task_specs"]
    if not isinstance(specs, list) or not specs:
        raise RecipeError(f"task_specs: expected a non-empty list of tasks, got {specs!r}")
    out = {k: copy.deepcopy(data[k]) for k in _PASS_THROUGH_KEYS if data.get(k) is not None}
    out.setdefault("name", name)
    for key in _GENERATION_KEYS:
        if data.get(key) is not None:
            out.setdefault("generation", {}).setdefault(key, data[key])
    out["tasks"] = [_task_to_rlhf_ext(i, spec, bank) for i, spec in enumerate(specs)]
    return out


def detect_config_format(data: Any) -> Literal["aif-gen", "rlhf-ext"]:
    """``aif-gen`` for a mapping with ``task_specs`` (an AIF-Gen task config), else ``rlhf-ext``."""
    return "aif-gen" if isinstance(data, dict) and "task_specs" in data else "rlhf-ext"
