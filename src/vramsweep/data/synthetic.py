"""Embedded synthetic grant reports: long, structured documents whose later sections depend on earlier ones.

Every document is generated from its own ``random.Random`` stream (seeded from ``(seed, index)``, never the
global RNG), so ``generate_documents(n, seed)[:k] == generate_documents(k, seed)`` and the output is identical
across runs and machines. Names, places and topics come from the fixed word lists below; the prose is built
from a few hundred sentence templates with a strongly repeated structure so that a small language model
can learn the language in a few hundred pre-training steps.

Section plan (10-14 sections, ~1500-4000 words per document)::

    0  Project summary          states the ACRONYM and the coordinator
    1  Consortium               states the partner count
    2  Objectives               states the number of work packages
    3.. Work package 1..N       N = 2..5, the longest sections
    .  Budget                   a table with a TOTAL row (states the budget total)
    .  Timeline and milestones  states the start date
    .  Risks and mitigation
    .  0-2 optional sections    (impact, dissemination, ethics, data management)
    .  Financial summary        repeats the budget total and the partner count
    .  Conclusions              repeats the acronym, coordinator, start date and work-package count

The *facts* record which value is stated where (``stated_in``: first section containing it) and every later
section that repeats it verbatim (``repeated_in``). Values are random (acronyms, names, dates, amounts), so a
later value is predictable only when the section that stated it is in the model's context: this is what the
task score measures when the context is truncated.
"""

from __future__ import annotations

import random
from typing import Any

from vramsweep.data.documents import document_text, format_section, value_occurs

__all__ = [
    "FACT_KEYS",
    "generate_documents",
    "STATING_SECTIONS",
    "pretrain_documents",
    "pretrain_texts",
    "without_statements",
]

FIRST_NAMES = (
    "Anna",
    "Lars",
    "Maria",
    "Jonas",
    "Ingrid",
    "Pietro",
    "Sofia",
    "Tomas",
    "Elena",
    "Mikael",
    "Chiara",
    "Henrik",
    "Laura",
    "Dariusz",
    "Ines",
    "Matteo",
    "Greta",
    "Pavel",
    "Nora",
    "Andreas",
    "Clara",
    "Ruben",
    "Marta",
    "Kristof",
    "Helena",
    "Joao",
    "Lena",
    "Stefan",
    "Alma",
    "Viktor",
    "Emilia",
    "Bruno",
    "Petra",
    "Oskar",
    "Lucia",
    "Florian",
    "Katja",
    "Radu",
    "Irene",
    "Sven",
)
LAST_NAMES = (
    "Lindqvist",
    "Kowalski",
    "Moreau",
    "Bianchi",
    "Novak",
    "Jansen",
    "Costa",
    "Fischer",
    "Horvath",
    "Nielsen",
    "Rossi",
    "Dubois",
    "Schmidt",
    "Petrov",
    "Silva",
    "Virtanen",
    "Ortega",
    "Keller",
    "Varga",
    "Eriksson",
    "Marino",
    "Leclerc",
    "Wagner",
    "Popescu",
    "Almeida",
    "Berg",
    "Romano",
    "Fontaine",
    "Hofmann",
    "Dvorak",
    "Sandoval",
    "Holm",
    "Ricci",
    "Laurent",
    "Becker",
    "Nagy",
    "Pereira",
    "Strand",
    "Galli",
    "Mertens",
)
CITIES = (
    ("Uppsala", "Sweden"),
    ("Krakow", "Poland"),
    ("Lyon", "France"),
    ("Bologna", "Italy"),
    ("Brno", "Czechia"),
    ("Utrecht", "the Netherlands"),
    ("Porto", "Portugal"),
    ("Freiburg", "Germany"),
    ("Szeged", "Hungary"),
    ("Aarhus", "Denmark"),
    ("Turin", "Italy"),
    ("Grenoble", "France"),
    ("Leipzig", "Germany"),
    ("Iasi", "Romania"),
    ("Coimbra", "Portugal"),
    ("Tampere", "Finland"),
    ("Valencia", "Spain"),
    ("Ghent", "Belgium"),
    ("Graz", "Austria"),
    ("Trondheim", "Norway"),
    ("Ljubljana", "Slovenia"),
    ("Tartu", "Estonia"),
    ("Galway", "Ireland"),
    ("Delft", "the Netherlands"),
    ("Salamanca", "Spain"),
)
INSTITUTION_PATTERNS = (
    "University of {city}",
    "{city} Institute of Technology",
    "{city} Research Centre for {field}",
    "{city} University Hospital",
    "{city} National Laboratory for {field}",
    "{city} School of {field}",
)
FIELDS = (
    "Environmental Science",
    "Applied Physics",
    "Public Health",
    "Materials Engineering",
    "Data Science",
    "Agriculture",
    "Energy Systems",
    "Marine Biology",
    "Social Policy",
    "Urban Planning",
    "Chemistry",
)
COMPANY_PATTERNS = (
    "{name} Analytics",
    "{name} Systems",
    "{name} Engineering",
    "{name} Labs",
    "{name} Solutions",
)
COMPANY_NAMES = (
    "Nordlys",
    "Altavia",
    "Brightwater",
    "Kestrel",
    "Solvera",
    "Meridian",
    "Bluefin",
    "Corvid",
    "Helix",
    "Quanta",
    "Terrafirm",
    "Windmere",
    "Lumen",
    "Ostara",
    "Silvan",
)
TOPICS = (
    ("coastal flood forecasting", "flood risk", "coastal municipalities"),
    ("soil microbiome monitoring", "soil health", "farmers"),
    ("battery recycling", "material recovery", "recycling plants"),
    ("early detection of sepsis", "patient outcomes", "hospital clinicians"),
    ("urban heat mitigation", "heat exposure", "city planners"),
    ("sustainable aquaculture", "fish welfare", "aquaculture operators"),
    ("low-carbon cement", "process emissions", "cement producers"),
    ("wildfire early warning", "fire spread", "civil protection agencies"),
    ("rural broadband access", "digital inclusion", "regional authorities"),
    ("air quality sensing", "pollutant exposure", "environmental agencies"),
    ("precision irrigation", "water use", "growers"),
    ("hydrogen storage", "storage efficiency", "energy utilities"),
    ("mental health support for students", "student wellbeing", "universities"),
    ("pollinator conservation", "pollinator decline", "land managers"),
    ("microplastic removal", "water contamination", "water utilities"),
    ("circular textiles", "textile waste", "clothing manufacturers"),
)
METHODS = (
    "machine learning models",
    "field experiments",
    "a network of low-cost sensors",
    "participatory workshops",
    "high-resolution simulations",
    "a randomised controlled trial",
    "life-cycle assessment",
    "remote sensing data",
    "laboratory prototypes",
    "stakeholder interviews",
    "open data platforms",
    "digital twins",
    "pilot installations",
    "longitudinal surveys",
    "process optimisation",
)
OUTPUTS = (
    "an open-source toolkit",
    "a validated prototype",
    "a decision-support dashboard",
    "policy guidelines",
    "a public dataset",
    "a training curriculum",
    "a technical standard proposal",
    "a business plan",
    "a set of best-practice reports",
    "a mobile application",
    "a reference architecture",
)
ADJECTIVES = (
    "robust",
    "scalable",
    "affordable",
    "transparent",
    "reliable",
    "inclusive",
    "efficient",
    "modular",
    "interoperable",
    "sustainable",
)
VERBS = (
    "develop",
    "validate",
    "demonstrate",
    "integrate",
    "evaluate",
    "deploy",
    "co-design",
    "benchmark",
    "characterise",
    "scale up",
)
WP_TITLES = (
    "Project management and coordination",
    "Requirements and co-design",
    "Data collection and curation",
    "Model development",
    "Prototype design",
    "Field validation",
    "Pilot demonstrations",
    "Impact assessment",
    "Dissemination, exploitation and communication",
    "Training and capacity building",
    "Integration and testing",
    "Policy and market uptake",
)
RISKS = (
    (
        "delays in recruiting qualified staff",
        "early advertising of positions and shared recruitment across partners",
    ),
    ("limited access to field sites", "agreements with alternative sites signed before the start"),
    ("lower than expected data quality", "redundant collection and automated quality checks"),
    ("departure of a key partner", "a consortium agreement that allows tasks to be reassigned"),
    ("insufficient stakeholder engagement", "a dedicated engagement plan and an advisory board"),
    ("technical failure of the prototype", "modular design and a fallback configuration"),
    ("changes in the regulatory framework", "continuous monitoring of policy developments"),
    ("cost overruns for equipment", "a contingency reserve and early procurement"),
)
MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}
SYLLABLES = (
    "KA",
    "LO",
    "TRI",
    "VE",
    "NO",
    "SA",
    "MI",
    "RA",
    "TE",
    "ZO",
    "PA",
    "LI",
    "DU",
    "GRE",
    "CO",
    "FA",
    "XI",
    "BRA",
    "NE",
    "TU",
    "ME",
    "RO",
    "VI",
    "SE",
    "DA",
    "QUA",
    "ON",
    "EL",
)
OPTIONAL_SECTIONS = ("Expected impact", "Dissemination and exploitation", "Ethics", "Data management")

FACT_KEYS = (
    "acronym",
    "coordinator",
    "partner_count",
    "num_work_packages",
    "budget_total",
    "start_date",
)


def _money(amount: int) -> str:
    return f"{amount:,}"


def _sentences(rng: random.Random, pool: tuple[str, ...], k: int, **slots: str) -> list[str]:
    """``k`` distinct templates from ``pool`` (in a random order), filled with ``slots``."""
    return [t.format(**slots) for t in rng.sample(pool, min(k, len(pool)))]


class _Ctx:
    """Random choices shared by all sections of one document."""

    def __init__(self, rng: random.Random, index: int, seed: int) -> None:
        self.rng = rng
        self.topic, self.aspect, self.users = rng.choice(TOPICS)
        self.acronym = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
        self.coordinator = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
        self.title_prefix = rng.choice(("Dr", "Prof."))
        self.n_wps = rng.randint(2, 5)
        # Never equal to the work-package count: both are written as number words, and a coincidence
        # would make one fact predictable from the other's section.
        self.n_partners = rng.choice([k for k in range(3, 10) if k != self.n_wps])
        self.methods = rng.sample(METHODS, 4)
        self.outputs = rng.sample(OUTPUTS, 3)
        self.adjective = rng.choice(ADJECTIVES)
        cities = rng.sample(CITIES, self.n_partners)
        self.partners: list[tuple[str, str, str]] = []  # (name, city, country)
        used: set[str] = set()
        for j, (city, country) in enumerate(cities):
            if j > 0 and rng.random() < 0.3:
                name = rng.choice(COMPANY_PATTERNS).format(name=rng.choice(COMPANY_NAMES))
            else:
                name = rng.choice(INSTITUTION_PATTERNS).format(city=city, field=rng.choice(FIELDS))
            while name in used:  # two companies may draw the same name: make it unique
                name = f"{name} {city}"
            used.add(name)
            self.partners.append((name, city, country))
        self.duration = rng.choice((24, 30, 36, 42, 48))
        self.start_date = f"{rng.randint(1, 28)} {rng.choice(MONTHS)} {rng.randint(2025, 2028)}"
        self.wp_titles = [WP_TITLES[0], *rng.sample(WP_TITLES[1:], self.n_wps - 1)]
        self.id = f"synth-{seed}-{index:05d}"
        self.title = f"{self.adjective.capitalize()} {self.topic} through {self.methods[0]}"
        # Budget rows (amounts in EUR, rounded to hundreds).
        personnel = rng.randint(1500, 9000) * 100 * self.n_partners // 3
        rows = [
            ("Personnel", personnel),
            ("Travel and subsistence", rng.randint(80, 600) * 100),
            ("Equipment", rng.randint(100, 2500) * 100),
            ("Consumables", rng.randint(50, 900) * 100),
            ("Subcontracting", rng.randint(0, 1200) * 100),
            ("Other direct costs", rng.randint(20, 400) * 100),
        ]
        direct = sum(a for _, a in rows)
        rows.append(("Indirect costs (25%)", direct // 4 // 100 * 100))
        self.budget_rows = rows
        self.budget_total = sum(a for _, a in rows)


# --------------------------------------------------------------------------------------------- sections
def _summary(c: _Ctx) -> str:
    r = c.rng
    host = c.partners[0][0]
    first = (
        f"{c.acronym} ({c.title}) is a research and innovation project coordinated by "
        f"{c.title_prefix} {c.coordinator} at {host}."
    )
    pool = (
        "The project addresses {aspect} in the field of {topic}, a challenge that affects {users} "
        "across Europe.",
        "Current approaches to {topic} are fragmented, expensive and rarely tested under real conditions.",
        "We will combine {m1} with {m2} to deliver {o1} that {users} can adopt without specialist support.",
        "The consortium has a strong track record in {topic} and in working directly with {users}.",
        "Our approach is {adj}, open and designed together with the people who will use the results.",
        "By the end of the project, {users} will have access to {o2} and to evidence on what works.",
        "The results will be shared openly and will inform national and European policy on {aspect}.",
        "Existing solutions for {aspect} do not scale, and their costs remain too high for most {users}.",
        "Recent advances in {m1} make it possible, for the first time, to address {aspect} at a "
        "realistic cost.",
        "The project is built around pilots in which {users} test the new methods in their daily work.",
        "Particular attention is given to the needs of small organisations, which are often left behind.",
        "The expected results go well beyond the state of the art in {topic}.",
    )
    rest = _sentences(
        r,
        pool,
        r.randint(6, 9),
        aspect=c.aspect,
        topic=c.topic,
        users=c.users,
        m1=c.methods[0],
        m2=c.methods[1],
        o1=c.outputs[0],
        o2=c.outputs[1],
        adj=c.adjective,
    )
    return " ".join([first, *rest])


def _consortium(c: _Ctx) -> str:
    r = c.rng
    n = NUMBER_WORDS[c.n_partners]
    countries = sorted({country for _, _, country in c.partners})
    lines = [
        f"The consortium brings together {n} partners from {len(countries)} "
        f"{'country' if len(countries) == 1 else 'countries'}, combining research excellence with "
        f"practical experience in {c.topic}."
    ]
    roles = (
        "leads the technical work on {m}",
        "contributes expertise in {m}",
        "hosts the pilot activities and works with {users}",
        "is responsible for data management and open science",
        "leads the evaluation of {aspect}",
        "brings industrial experience and prepares exploitation",
        "coordinates dissemination and communication",
        "develops the training materials for {users}",
    )
    for j, (name, city, country) in enumerate(c.partners, start=1):
        role = r.choice(roles).format(m=r.choice(c.methods), users=c.users, aspect=c.aspect)
        tag = " (coordinator)" if j == 1 else ""
        lines.append(f"- Partner {j}{tag}: {name}, {city} ({country}), {role}.")
    pool = (
        "The partners have collaborated in earlier national projects and share common tools and "
        "data formats.",
        "Each partner was selected for a specific role, and there is no duplication of expertise.",
        "The consortium includes both academic and non-academic partners to ensure real-world uptake.",
        "Decisions are taken by a steering committee in which every partner has one vote.",
        "An advisory board of external experts and representatives of {users} supports the consortium.",
        "The coordinator has managed several European projects of a similar size.",
    )
    lines.append(" ".join(_sentences(r, pool, r.randint(3, 5), users=c.users)))
    return "\n".join(lines)


def _objectives(c: _Ctx) -> str:
    r = c.rng
    n_obj = r.randint(3, 6)
    lines = [
        f"The overall aim of the project is to make {c.topic} {c.adjective} and affordable for {c.users}. "
        f"The work is organised in {NUMBER_WORDS[c.n_wps]} work packages, and the project pursues "
        "the following specific objectives:"
    ]
    templates = (
        "To {verb} {m} for {aspect} under real operating conditions.",
        "To {verb} {o} together with {users}.",
        "To benchmark the performance of {m} against current practice.",
        "To establish a common framework for sharing data on {aspect}.",
        "To quantify the economic and social benefits of the new approach.",
        "To strengthen the skills of {users} through targeted training.",
        "To {verb} {m} in at least one pilot site per partner country.",
    )
    for k, t in enumerate(r.sample(templates, n_obj), start=1):
        text = t.format(
            verb=r.choice(VERBS), m=r.choice(c.methods), aspect=c.aspect, o=r.choice(c.outputs), users=c.users
        )
        lines.append(f"- O{k}: {text}")
    pool = (
        "Each objective is linked to measurable indicators that are reported at every review.",
        "The objectives are ambitious but realistic given the resources and the experience of the partners.",
        "Progress towards the objectives is monitored by the steering committee twice a year.",
        "Together, the objectives cover the full path from research to adoption by {users}.",
    )
    lines.append(" ".join(_sentences(r, pool, r.randint(2, 4), users=c.users)))
    return "\n".join(lines)


def _work_package(c: _Ctx, k: int) -> str:
    r = c.rng
    lead = r.choice(c.partners)[0]
    start = 1 if k == 1 else r.randint(1, c.duration // 2)
    end = r.randint(max(start + 6, c.duration // 2), c.duration - 1)
    lines = [f"Lead partner: {lead}. Duration: from month {start} to month {end}."]
    intro_pool = (
        "This work package lays the foundations for the rest of the project.",
        "The aim of this work package is to {verb} {m} for {aspect}.",
        "This work package brings together the partners working on {m} and {m2}.",
        "The activities in this work package are closely linked to the needs of {users}.",
        "The work package starts with a review of existing approaches to {topic}.",
        "Its results are a precondition for the pilots and for the final evaluation.",
        "All partners contribute to this work package, each according to its expertise.",
    )
    lines.append(
        " ".join(
            _sentences(
                r,
                intro_pool,
                r.randint(3, 5),
                verb=r.choice(VERBS),
                m=r.choice(c.methods),
                m2=r.choice(c.methods),
                aspect=c.aspect,
                users=c.users,
                topic=c.topic,
            )
        )
    )
    task_pool = (
        "We will {verb} {m} using data from the pilot sites and compare the results with current practice.",
        "The partners will {verb} {o} and document every design decision in a shared repository.",
        "This task will collect the requirements of {users} through interviews and workshops.",
        "A dedicated team will check the quality of the data and publish the cleaned dataset.",
        "The task will test the approach in different regions to assess its generality.",
        "Results will be reviewed by the advisory board, and the plan will be adjusted where needed.",
        "We will {verb} {m} with a focus on {aspect} and on the costs for {users}.",
        "The task produces intermediate results that feed directly into the following work packages.",
        "Special attention will be paid to gender balance and to the involvement of early-career "
        "researchers.",
        "The software developed in this task will be released under an open licence.",
        "The partners will hold monthly technical meetings to coordinate the work.",
        "Performance will be measured against indicators agreed with {users} at the start of the task.",
        "A first version will be ready early, so that {users} can give feedback before the final design.",
        "The task builds on {m} developed by the partners in earlier projects.",
        "Lessons learned will be summarised in a short report that is shared with all partners.",
        "Where possible, the task reuses existing open data on {aspect} instead of collecting new data.",
    )
    n_tasks = r.randint(3, 5) + (5 - c.n_wps) // 2  # fewer work packages, longer ones
    for t in range(1, n_tasks + 1):
        body = " ".join(
            _sentences(
                r,
                task_pool,
                r.randint(3, 5),
                verb=r.choice(VERBS),
                m=r.choice(c.methods),
                o=r.choice(c.outputs),
                users=c.users,
                aspect=c.aspect,
            )
        )
        lines.append(f"Task {k}.{t}: {body}")
    n_del = r.randint(1, 3)
    dels = [
        f"D{k}.{d} {output} (month {month})"
        for d, (output, month) in enumerate(
            zip(r.sample(OUTPUTS, n_del), sorted(r.randint(start + 3, end) for _ in range(n_del))), start=1
        )
    ]
    lines.append("Deliverables: " + "; ".join(dels) + ".")
    return "\n".join(lines)


def _budget(c: _Ctx) -> str:
    r = c.rng
    lines = [
        "The budget below covers all eligible costs of the consortium. Amounts are in EUR.",
        "",
        "| Cost category | Amount (EUR) |",
        "| --- | --- |",
    ]
    for name, amount in c.budget_rows:
        lines.append(f"| {name} | {_money(amount)} |")
    lines.append(f"| TOTAL | {_money(c.budget_total)} |")
    lines.append("")
    pool = (
        "Personnel costs are the largest item, reflecting the research effort of the partners.",
        "Equipment costs cover the sensors and computing resources needed for the pilots.",
        "Travel costs include consortium meetings, pilot visits and conference participation.",
        "Indirect costs are calculated as a flat rate of 25% of the direct costs.",
        "Subcontracting is limited to tasks that cannot be performed by the partners themselves.",
        "Consumables are mainly needed for the laboratory work and the field campaigns.",
    )
    lines.append(" ".join(_sentences(r, pool, r.randint(3, 5))))
    return "\n".join(lines)


def _timeline(c: _Ctx) -> str:
    r = c.rng
    lines = [
        f"The project starts on {c.start_date} and runs for {c.duration} months. "
        "The main milestones are listed below."
    ]
    ms_pool = (
        "requirements agreed with {users}",
        "first version of {o} available",
        "pilot sites operational",
        "mid-term review completed",
        "validation results published",
        "final version of {o} released",
        "exploitation plan approved",
    )
    n_ms = r.randint(3, 6)
    months = sorted(r.sample(range(3, c.duration + 1), n_ms))
    for k, (month, t) in enumerate(zip(months, r.sample(ms_pool, n_ms)), start=1):
        lines.append(f"- MS{k} (month {month}): {t.format(users=c.users, o=r.choice(c.outputs))}.")
    pool = (
        "The timeline leaves a margin before the end of the project for the final evaluation.",
        "Milestones are verified by the steering committee before the next phase begins.",
        "A Gantt chart with all tasks is maintained by the coordinator and shared with the partners.",
        "The pilots are scheduled so that seasonal effects can be observed at every site.",
    )
    lines.append(" ".join(_sentences(r, pool, r.randint(2, 4))))
    return "\n".join(lines)


def _risks(c: _Ctx) -> str:
    r = c.rng
    lines = [
        "The main risks identified during the preparation of the proposal are listed with their mitigation."
    ]
    for risk, mitigation in r.sample(RISKS, r.randint(3, 6)):
        likelihood = r.choice(("low", "medium", "high"))
        lines.append(f"- Risk: {risk} (likelihood: {likelihood}). Mitigation: {mitigation}.")
    lines.append("The risk register is updated at every steering committee meeting.")
    return "\n".join(lines)


def _optional(c: _Ctx, heading: str) -> str:
    r = c.rng
    pools = {
        "Expected impact": (
            "The project will reduce {aspect} for {users} and create new opportunities for "
            "European companies.",
            "We expect {o} to be adopted by many organisations soon after the end of the project.",
            "The results contribute to the European Green Deal and to the Sustainable Development Goals.",
            "Better evidence on {aspect} will support more effective public policy.",
            "The approach can be transferred to other regions and to related problems in {topic}.",
            "The project will also strengthen the scientific community working on {topic}.",
        ),
        "Dissemination and exploitation": (
            "Results will be published in open-access journals and presented at international conferences.",
            "A project website and newsletter will keep {users} informed about progress.",
            "The partners will prepare an exploitation plan for {o}, including licensing options.",
            "Workshops with {users} will be held in every participating country.",
            "All public deliverables will be available on the project website.",
            "A final conference will present the results to policy makers and to {users}.",
        ),
        "Ethics": (
            "The project involves human participants, and informed consent will be obtained in every case.",
            "All personal data will be processed in line with the General Data Protection Regulation.",
            "An independent ethics advisor will review the protocols before the pilots begin.",
            "No research activity raises dual-use concerns.",
            "Participants can withdraw from the study at any time without giving a reason.",
        ),
        "Data management": (
            "A data management plan will be delivered early in the project.",
            "Data will be findable, accessible, interoperable and reusable, following the FAIR principles.",
            "Datasets will be deposited in a trusted open repository with a persistent identifier.",
            "Sensitive data will be stored on secure servers at the partner that collected them.",
            "Metadata will follow community standards for {topic}.",
        ),
    }
    return " ".join(
        _sentences(
            r,
            pools[heading],
            r.randint(4, len(pools[heading])),
            aspect=c.aspect,
            users=c.users,
            o=r.choice(c.outputs),
            topic=c.topic,
        )
    )


def _financial_summary(c: _Ctx) -> str:
    r = c.rng
    personnel_pct = round(100 * c.budget_rows[0][1] / c.budget_total)
    first = (
        f"The total budget of EUR {_money(c.budget_total)} is shared among the {NUMBER_WORDS[c.n_partners]} "
        "partners according to their role in the work plan."
    )
    pool = (
        f"Personnel costs account for about {personnel_pct}% of the total.",
        "The coordinator receives a small additional share for project management.",
        "Funds are transferred to the partners after each reporting period.",
        "The budget is consistent with the effort planned in the work packages.",
        "Any changes to the budget must be approved by the steering committee.",
    )
    return " ".join([first, *_sentences(r, pool, r.randint(2, 4))])


def _conclusions(c: _Ctx) -> str:
    r = c.rng
    first = (
        f"In summary, {c.acronym} is coordinated by {c.title_prefix} {c.coordinator}, starts on "
        f"{c.start_date} and is organised in {NUMBER_WORDS[c.n_wps]} work packages."
    )
    pool = (
        "The project will deliver {o} and lasting benefits for {users}.",
        "The consortium is ready to start immediately and has secured access to all pilot sites.",
        "We are convinced that the project offers excellent value for money.",
        "The approach is {adj} and builds on the complementary strengths of the partners.",
        "The results will remain available after the end of the project.",
    )
    return " ".join(
        [first, *_sentences(r, pool, r.randint(2, 4), o=r.choice(c.outputs), users=c.users, adj=c.adjective)]
    )


# --------------------------------------------------------------------------------------------- documents
def _fact_values(c: _Ctx) -> dict[str, str]:
    return {
        "acronym": c.acronym,
        "coordinator": c.coordinator,
        "partner_count": NUMBER_WORDS[c.n_partners],
        "num_work_packages": NUMBER_WORDS[c.n_wps],
        "budget_total": _money(c.budget_total),
        "start_date": c.start_date,
    }


def _document(rng: random.Random, index: int, seed: int) -> dict[str, Any]:
    c = _Ctx(rng, index, seed)
    sections: list[tuple[str, str]] = [
        ("Project summary", _summary(c)),
        ("Consortium", _consortium(c)),
        ("Objectives", _objectives(c)),
    ]
    for k, title in enumerate(c.wp_titles, start=1):
        sections.append((f"Work package {k}: {title}", _work_package(c, k)))
    sections.append(("Budget", _budget(c)))
    sections.append(("Timeline and milestones", _timeline(c)))
    sections.append(("Risks and mitigation", _risks(c)))
    n_opt = min(rng.randint(0, 2), 14 - len(sections) - 2)
    for heading in sorted(rng.sample(OPTIONAL_SECTIONS, n_opt), key=OPTIONAL_SECTIONS.index):
        sections.append((heading, _optional(c, heading)))
    sections.append(("Financial summary", _financial_summary(c)))
    sections.append(("Conclusions", _conclusions(c)))

    facts = []
    for key, value in _fact_values(c).items():
        where = [
            i
            for i, (h, t) in enumerate(sections)
            if value_occurs(format_section({"heading": h, "text": t}), value)
        ]
        if len(where) < 2:  # pragma: no cover - guarded by the construction above and by tests
            raise AssertionError(f"fact {key}={value!r} is not repeated (found in sections {where})")
        facts.append({"key": key, "value": value, "stated_in": where[0], "repeated_in": where[1:]})
    return {
        "id": c.id,
        "title": c.title,
        "sections": [{"heading": h, "text": t} for h, t in sections],
        "facts": facts,
    }


def generate_documents(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` deterministic synthetic grant reports (see the module docstring for their structure).

    Args:
        n: number of documents (>= 0).
        seed: any int; document ``i`` uses its own stream ``random.Random(f"doc:{seed}:{i}")``.

    Returns:
        Documents in the JSONL schema of :mod:`vramsweep.data.documents`:
        ``{"id", "title", "sections": [{"heading", "text"}], "facts": [{"key", "value", "stated_in",
        "repeated_in"}]}``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [_document(random.Random(f"doc:{seed}:{i}"), i, seed) for i in range(n)]


def pretrain_documents(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` documents for pre-training the embedded base model (same schema as :func:`generate_documents`).

    Uses a separate seed stream (``"pretrain:{seed}:{i}"``) from :func:`generate_documents`, so pre-training
    never sees the fine-tuning or evaluation documents.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [_document(random.Random(f"pretrain:{seed}:{i}"), i, seed) for i in range(n)]


def pretrain_texts(n: int, seed: int) -> list[str]:
    """The plain texts of :func:`pretrain_documents` ``(n, seed)``: sections rendered exactly as the training
    examples render them (:func:`vramsweep.data.documents.format_section`)."""
    return [document_text(d) for d in pretrain_documents(n, seed)]


STATING_SECTIONS = ("Project summary", "Consortium", "Objectives", "Budget", "Timeline and milestones")


def without_statements(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with every fact-stating section (:data:`STATING_SECTIONS`) removed; the repeats stay.

    The facts' first statements are gone from any context while everything else is as in the full
    document: the "lost context" control for fact-copying measurements.
    """
    keep = [j for j, s in enumerate(doc["sections"]) if s["heading"] not in STATING_SECTIONS]
    new = {old: k for k, old in enumerate(keep)}
    facts = [
        {**f, "stated_in": 0, "repeated_in": [new[r] for r in f["repeated_in"] if r in new]}
        for f in doc["facts"]
    ]
    return {**doc, "sections": [doc["sections"][j] for j in keep], "facts": facts}
