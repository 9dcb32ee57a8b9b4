"""What the decoder knows about one request's drafts: its checked drafts, whether it drafts now, and what
its verifications gained against what they cost.

A request is either drafting (its drafts are verified by the target) or watched. A watched request whose
proposer costs next to nothing to ask (the n-gram lookup) gets a shadow draft now and then: a draft that
is never verified, only checked against the tokens that then come, one by one, as a verification would
check it (for greedy requests exactly; for sampled ones the drafted token is the sampled one with the
chance rejection sampling accepts a one-hot draft with). So a request learns its acceptance without
paying for a verify row, and one whose text turns to copying its input starts drafting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decodeservice.engine.spec_decode.policy import BetaPrior, posterior_acceptance

# Weight of the past in a request's checked drafts, per verification or shadow draft: a memory of about
# ten, so a request that turns from prose to copying (or back) shows it within a few steps, and one
# lucky hit does not lift the estimate past the break-even point.
ACCEPTANCE_DECAY = 0.9
# Weight of the past in the engine-wide acceptance that new requests start from: a memory of about 50
# requests' verifications.
WORKLOAD_DECAY = 0.98
# A request whose verifications gained less than they cost stops drafting once they weigh this many
# plain steps' shares: enough that one unlucky verification does not stop a request that pays.
MIN_REALIZED_EVIDENCE = 4.0
# The longest wait, in steps, between a watched request's shadow drafts or probes: a request whose
# drafts keep failing costs one lookup (or one probe row) every 64 steps at most.
MAX_COOLDOWN = 64


@dataclass(kw_only=True)
class Workload:
    """Every request's checked drafts, decayed by WORKLOAD_DECAY: where a new request's prior comes from."""

    hits: float = 0.0
    misses: float = 0.0

    def record(self, *, proposed: int, accepted: int) -> None:
        self.hits = WORKLOAD_DECAY * self.hits + accepted
        self.misses = WORKLOAD_DECAY * self.misses + (1 if accepted < proposed else 0)

    @property
    def evidence(self) -> float:
        return self.hits + self.misses

    @property
    def acceptance(self) -> float:
        return self.hits / self.evidence if self.evidence > 0 else 0.0


@dataclass(kw_only=True)
class DraftingState:
    prior: BetaPrior
    hits: float = 0.0  # decayed count of drafts that landed (verified or shadow)
    misses: float = 0.0  # decayed count of rejections
    drafting: bool = False  # its drafts are verified; else it is watched
    cooldown: int = 0  # steps left before the next shadow draft or probe
    pauses: int = 0  # failed shadow drafts or probes in a row; the next wait is 2**pauses steps
    shadow: list[int] = field(default_factory=list)  # the shadow draft's tokens not yet checked
    shadow_start: int = 0  # where in the sequence's tokens the shadow draft's first token was due
    shadow_at: int = 0  # where the next of its unchecked tokens is due
    gain_tokens: float = 0.0  # tokens its verifications gave, decayed like the evidence
    gain_cost: float = 0.0  # what they cost, in plain-step shares (policy.verify_cost_units)
    verified: int = 0  # drafts verified over its life
    accepted: int = 0  # of them, accepted
    shadow_checked: int = 0  # shadow drafts' tokens checked over its life
    shadow_hits: int = 0

    @property
    def acceptance(self) -> float:
        return posterior_acceptance(self.hits, self.misses, self.prior)

    def record(self, *, proposed: int, accepted: int) -> None:
        """A verification (or a whole shadow draft) of `proposed` drafts, `accepted` of them landing."""
        self.hits = ACCEPTANCE_DECAY * self.hits + accepted
        self.misses = ACCEPTANCE_DECAY * self.misses + (1 if accepted < proposed else 0)

    def realized(self, *, tokens: int, cost_units: float) -> None:
        self.gain_tokens = ACCEPTANCE_DECAY * self.gain_tokens + tokens
        self.gain_cost = ACCEPTANCE_DECAY * self.gain_cost + cost_units

    def stop_drafting(self) -> None:
        """Back to being watched, for 2, 4, .. MAX_COOLDOWN steps before the next look."""
        self.drafting = False
        self.gain_tokens = self.gain_cost = 0.0
        self.back_off()

    def back_off(self) -> None:
        self.pauses += 1
        self.cooldown = min(2**self.pauses, MAX_COOLDOWN)

    def start_shadow(self, tokens: list[int], *, at: int) -> None:
        self.shadow, self.shadow_start, self.shadow_at = list(tokens), at, at
        # A shadow draft is evidence like a verification: the past decays once for it.
        self.hits *= ACCEPTANCE_DECAY
        self.misses *= ACCEPTANCE_DECAY

    def check_shadow(self, token_ids: list[int]) -> tuple[int, int] | None:
        """Check the shadow draft against the tokens that came since; (drafted, landed) once it is settled
        (a token differed, or all of them landed), else None. Each landed token counts at once, so a
        request that copies starts drafting after two or three, not after the whole shadow draft."""
        if not self.shadow:
            return None
        drafted = len(self.shadow) + self.shadow_at - self.shadow_start
        while self.shadow and self.shadow_at < len(token_ids):
            self.shadow_checked += 1
            if token_ids[self.shadow_at] != self.shadow[0]:
                self.misses += 1
                landed = self.shadow_at - self.shadow_start
                self.shadow = []
                return drafted, landed
            self.hits += 1
            self.shadow_hits += 1
            self.shadow.pop(0)
            self.shadow_at += 1
        return (drafted, drafted) if not self.shadow else None


@dataclass(kw_only=True)
class DecoderCounters:
    """Where speculation spends its time and what it got, for benchmarks and debugging (not metrics)."""

    steps: int = 0  # propose calls with a decoding sequence
    drafting_steps: int = 0  # of them, steps in which some sequence drafted
    propose_ms: float = 0.0  # all of propose: planning, lookups, shadow drafts, drafting
    settle_ms: float = 0.0  # all of settle: verification and rollback
    shadow_drafts: int = 0
    shadow_checked: int = 0  # shadow tokens checked against what came
    shadow_hits: int = 0
    probes: int = 0  # one-draft probes of watched requests (proposers that are not free to ask)
    starts: int = 0  # a watched request began drafting
    realized_stops: int = 0  # a drafting request stopped: its verifications gained less than they cost
    # per finished request: (drafts verified, accepted, shadow tokens checked, shadow hits), the last 512
    lifetimes: list[tuple[int, int, int, int]] = field(default_factory=list)

    def finished(self, state: DraftingState) -> None:
        self.lifetimes.append((state.verified, state.accepted, state.shadow_checked, state.shadow_hits))
        del self.lifetimes[:-512]
