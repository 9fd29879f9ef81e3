"""The golden set's raw material: per domain, who asks, four topics and two question forms.

``bench/make_golden.py`` crosses each domain's topics with its forms (8 prompts a domain),
adds 8 questions drawn from ``bench/data/stdlib_qa.jsonl`` (the domain the demo model was
trained on) and perturbs a seeded fifth of everything into adversarial variants.
"""

from __future__ import annotations

# Question forms; {topic} and {role} are filled in. Indexes are chosen per domain below.
FORMS = (
    "What is {topic}? Explain it to a {role} in two sentences.",
    "As a {role}, what are the main risks of {topic}?",
    "Give me a short checklist for {topic}.",
    "How does {topic} work, step by step?",
    "A {role} asks about {topic}. What should we answer?",
    "Summarize the rules for {topic} in one paragraph.",
    "What is the most common mistake with {topic}?",
    "Compare {topic} with the usual alternative for a {role}.",
)

# domain: (role, (topic x4), (form index, form index))
DOMAINS: dict[str, tuple[str, tuple[str, str, str, str], tuple[int, int]]] = {
    "finance": (
        "retail investor",
        (
            "a stop-loss order",
            "dollar-cost averaging",
            "bond duration",
            "the price-to-earnings ratio",
        ),
        (0, 1),
    ),
    "banking": (
        "bank customer",
        (
            "an overdraft fee",
            "a wire transfer cutoff time",
            "a fixed-rate mortgage",
            "two-factor login",
        ),
        (3, 4),
    ),
    "insurance": (
        "policyholder",
        ("a deductible", "a claim for water damage", "term life insurance", "a no-claims bonus"),
        (0, 6),
    ),
    "medical": (
        "patient",
        (
            "high blood pressure",
            "a fasting blood test",
            "antibiotic resistance",
            "a tetanus booster",
        ),
        (0, 2),
    ),
    "pharmacy": (
        "pharmacist",
        (
            "a drug interaction check",
            "a generic substitute",
            "storing insulin",
            "an expired prescription",
        ),
        (4, 6),
    ),
    "legal": (
        "tenant",
        (
            "a security deposit",
            "a notice period",
            "a non-disclosure agreement",
            "small claims court",
        ),
        (5, 1),
    ),
    "compliance": (
        "compliance officer",
        (
            "know-your-customer checks",
            "data retention limits",
            "a conflict of interest",
            "GDPR consent",
        ),
        (2, 5),
    ),
    "ecommerce_support": (
        "online shopper",
        (
            "a late delivery refund",
            "an exchange for a wrong size",
            "a failed card payment",
            "a cancelled order",
        ),
        (4, 3),
    ),
    "retail": (
        "store manager",
        ("inventory shrinkage", "a loyalty programme", "markdown pricing", "shelf replenishment"),
        (1, 7),
    ),
    "logistics": (
        "dispatcher",
        ("last-mile delivery", "a bill of lading", "cross-docking", "cold-chain shipping"),
        (3, 6),
    ),
    "travel": (
        "traveller",
        (
            "a missed connecting flight",
            "travel insurance",
            "a visa on arrival",
            "an overbooked hotel",
        ),
        (4, 2),
    ),
    "telecom": (
        "subscriber",
        ("roaming charges", "porting a phone number", "a dropped call rate", "a data cap"),
        (0, 4),
    ),
    "energy": (
        "homeowner",
        ("a smart meter", "time-of-use tariffs", "rooftop solar payback", "a heat pump"),
        (3, 7),
    ),
    "real_estate": (
        "first-time buyer",
        ("an escrow account", "a home inspection", "closing costs", "a leasehold"),
        (0, 2),
    ),
    "hr": (
        "new employee",
        ("a probation period", "parental leave", "a performance review", "remote work expenses"),
        (5, 4),
    ),
    "education": (
        "teacher",
        ("formative assessment", "a flipped classroom", "plagiarism detection", "grading rubrics"),
        (7, 2),
    ),
    "cybersecurity": (
        "system administrator",
        ("a phishing email", "password rotation", "least privilege", "a ransomware backup"),
        (1, 3),
    ),
    "marketing": (
        "marketer",
        ("an A/B test", "customer churn", "a conversion funnel", "email open rates"),
        (3, 6),
    ),
    "manufacturing": (
        "plant engineer",
        (
            "preventive maintenance",
            "a lean kanban board",
            "a defect rate",
            "statistical process control",
        ),
        (2, 0),
    ),
    "agriculture": (
        "farmer",
        ("crop rotation", "drip irrigation", "soil pH testing", "an organic certification"),
        (0, 1),
    ),
    "government": (
        "citizen",
        (
            "renewing a passport",
            "a tax filing deadline",
            "registering to vote",
            "a building permit",
        ),
        (4, 5),
    ),
    "code": (
        "Python developer",
        ("a list comprehension", "a context manager", "a generator function", "a dataclass"),
        (0, 6),
    ),
}

STDLIB_QUESTIONS = 8  # drawn from bench/data/stdlib_qa.jsonl, the "stdlib" domain

# Adversarial rewrites ("vague" and "ambiguous"); typos are made character by character.
VAGUE = (
    "so what about {topic} then",
    "{topic}?? is that bad or what",
    "hey quick one, the {topic} thing, how does that go",
)
AMBIGUOUS = (
    "Is it better?",
    "What about that one we discussed?",
    "Can you do the same for the other case?",
)
