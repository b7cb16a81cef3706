"""A plain, step-by-step restatement of CHE's ``ndstack_rnn`` (CHE models/ndstack_rnn.py and
models/rnn.py, written out from the spec's section 4), one member and one step at a time, with
the full ``stack_size`` x ``stack_size`` gamma and JAX's indexing made explicit: a gather at an
index past the end reads the last entry, a scatter there is dropped. The test oracle for
``che_bench.model.recurrent.ndstack_rnn``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPSILON = 0.001


def jax_get(array: torch.Tensor, axis: int, index: int) -> torch.Tensor:
    """``array`` indexed at ``index`` along ``axis`` as JAX gathers: clamped into range."""
    return array.select(axis, min(index, array.shape[axis] - 1))


def jax_set(array: torch.Tensor, axis: int, index: int, value: torch.Tensor) -> torch.Tensor:
    """``array`` with ``value`` at ``index`` along ``axis`` as JAX's ``.at[].set`` scatters:
    out of range, the update is dropped."""
    if index >= array.shape[axis]:
        return array
    array = array.clone()
    array.select(axis, index).copy_(value)
    return array


def che_update(gamma, alpha, push, pop, replace, t: int, read_states: bool):
    """CHE's ``_update_stack`` at step ``t`` for gamma ``[B, N, N, Q, S, Q, S]`` (source,
    target), alpha ``[B, N, Q, S]``, push/replace ``[B, Q, S, Q, S]``, pop ``[B, Q, S, Q]``:
    (gamma, alpha, read)."""
    size = gamma.shape[2]
    mask = torch.zeros(size, size, dtype=gamma.dtype)
    if t < size:  # both indices (t - 1, t) in range, else the scatter is dropped
        mask[t - 1, t] = 1.0
    pushed = jax_get(torch.einsum("bqxry,iT->biTqxry", push, mask), 2, t)
    k = torch.arange(size)
    between = ((k[None, :] > k[:, None]) & (k[None, :] < t - 1)).to(gamma.dtype)  # [i, k]
    previous = jax_get(gamma, 2, t - 1)  # gamma[k -> t-1]: [B, k, Q, S, Q, S]
    popped = torch.einsum(
        "bikqxuy,bkuysz,bszr->biqxry",
        between[None, :, :, None, None, None, None] * gamma,
        previous,
        pop,
    )
    replaced = torch.einsum("biqxsz,bszry->biqxry", previous, replace)
    gamma = jax_set(gamma, 2, t, pushed + popped + replaced)
    alpha_t = torch.einsum("biqx,biqxry->bry", alpha, jax_get(gamma, 2, t))
    alpha = jax_set(alpha, 1, t, alpha_t)
    read = alpha_t.flatten(1) if read_states else alpha_t.sum(dim=1)
    return gamma, alpha, read / (read.sum(dim=-1, keepdim=True) + EPSILON)


def oracle_logits(model, inputs: torch.Tensor) -> torch.Tensor:
    """Logits ``[M, B, read, output]`` of an ``ndstack_rnn`` RecurrentModel for ``inputs
    [B, n]``, member by member and step by step."""
    tokens, read = model.with_output_tokens(model.member_inputs(inputs))
    memory, cell = model.memory, model.cell
    q, s, size = memory.states, memory.symbols, memory.size
    members, batch, steps = tokens.shape
    result = []
    for m in range(members):
        h = torch.zeros(batch, cell.hidden_size)
        stack_read = torch.zeros(batch, memory.width)
        gamma = torch.zeros(batch, size, size, q, s, q, s)
        alpha = torch.zeros(batch, size, q, s)
        alpha[:, 0, 0, 0] = 1.0
        outputs = []
        for step in range(steps):
            x = torch.cat([F.one_hot(tokens[m, :, step], cell.tokens).float(), stack_read], -1)
            h = torch.relu(
                x @ cell.input_to_hidden.weight[m].T
                + cell.input_to_hidden.bias[m]
                + h @ cell.hidden_to_hidden.weight[m].T
                + cell.hidden_to_hidden.bias[m]
            )
            actions = torch.softmax(h @ memory.actions.weight[m].T + memory.actions.bias[m], -1)
            push, pop, replace = actions.split([(q * s) ** 2, q * q * s, (q * s) ** 2], -1)
            gamma, alpha, stack_read = che_update(
                gamma,
                alpha,
                push.reshape(batch, q, s, q, s),
                pop.reshape(batch, q, s, q),
                replace.reshape(batch, q, s, q, s),
                step + 1,
                memory.read_states,
            )
            outputs.append(h)
        hidden = torch.relu(torch.stack(outputs[steps - read :], dim=1))
        result.append(hidden @ model.head.weight[m].T + model.head.bias[m])
    return torch.stack(result)
