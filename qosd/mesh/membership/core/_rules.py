"""The update order: which news about a member replaces what is known.

A member's known state is a pair (incarnation, state).  An update replaces it
iff its pair is greater in lexicographic order, with the states ranked
``ALIVE < SUSPECT < DEAD < LEFT`` (SWIM's rules, extended to dead and left)::

    known \\ update  alive(j)   suspect(j)  dead(j)   left(j)
    alive(i)        j > i      j >= i      j >= i    j >= i
    suspect(i)      j > i      j > i       j >= i    j >= i
    dead(i)         j > i      j > i       j > i     j >= i
    left(i)         j > i      j > i       j > i     j > i

So only the member itself, by raising its incarnation (refuting), moves from
suspect/dead/left back to alive.  Because this is a total order and every
member keeps the maximum it has seen, members that saw the same updates agree,
whatever order the updates arrived in.  Two refinements: a repeated suspect at
the same pair is a *confirmation* (Lifeguard), and updates about oneself are
never applied but refuted (``must_refute``).

memberlist differs in one place: it ignores suspect(j > i) about a dead member;
here it applies, which lets a member declared dead come back through a
suspicion it then refutes (a healed partition converges).
"""

from __future__ import annotations

from ._messages import Alive, Dead, Leave, MemberRow, State, Suspect, Update


def precedence(state: State, incarnation: int) -> tuple[int, int]:
    """The sort key of a member state: (incarnation, state rank)."""
    return (incarnation, int(state))


def overrides(new: State, new_inc: int, cur: State, cur_inc: int) -> bool:
    """True iff news (new, new_inc) replaces the known (cur, cur_inc)."""
    return new_inc > cur_inc or (new_inc == cur_inc and new > cur)


def update_state(msg: Update) -> State:
    """The member state an update message asserts."""
    if isinstance(msg, Alive):
        return State.ALIVE
    if isinstance(msg, Suspect):
        return State.SUSPECT
    if isinstance(msg, Dead):
        return State.DEAD
    return State.LEFT


def must_refute(msg: Update, my_inc: int, my_addr: str, leaving: bool) -> bool:
    """Whether news about this member itself calls for a refutation (a fresh
    alive with a higher incarnation).  Accusations at or above the current
    incarnation are refuted unless this member is leaving; an alive is refuted
    when it is newer than ours or names another address (e.g. left over from a
    previous run with the same id)."""
    if leaving:
        return False
    if isinstance(msg, Alive):
        return msg.incarnation > my_inc or (msg.incarnation == my_inc and msg.addr != my_addr)
    return msg.incarnation >= my_inc


def row_update(row: MemberRow, me: str) -> Update:
    """The update a push-pull row stands for.  As in memberlist, a remote's
    dead is taken as a suspicion (accused by ``me``): stale knowledge must not
    kill a member at once, it gets a suspicion timeout to refute."""
    if row.state == State.ALIVE:
        return Alive(row.node, row.addr, row.incarnation)
    if row.state == State.LEFT:
        return Leave(row.node, row.incarnation)
    return Suspect(row.node, row.incarnation, me)
