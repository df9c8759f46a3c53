"""Test oracles of the MTP proposer: drafts and hidden states recomputed from scratch, no cache."""
import torch


def mtp_input_hidden(model, tokens):
    """[1, n-1, H]: the trunk state the first MTP layer reads (family-dependent), positions 0..n-2."""
    n = tokens.shape[1]
    return model.forward_states(tokens, torch.arange(n)[None])[1][:, :n - 1]


def reference_mtp_hidden(model, ids, num_layers=None):
    """Every MTP layer's output over the whole sequence `ids`, recomputed without any cache:
    [layer j -> [1, len(ids)-j-1, H]], layer j at position t reading layer j-1's output at t
    (the trunk's for j = 0) and token t+j+1 (megatron-core's MTP block)."""
    n = len(ids)
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        hidden = mtp_input_hidden(model, tokens)
        outs = []
        for j in range(model.num_mtp_layers if num_layers is None else num_layers):
            width = n - j - 1
            hidden = model.mtp_forward(j, tokens[:, j + 1:j + 1 + width], hidden[:, :width],
                                       torch.arange(width)[None])
            outs.append(hidden)
    return outs


def reference_mtp_drafts(model, ids, k):
    """Greedy MTP drafts for `ids` recomputed from scratch without any cache (the naive path
    the cached proposer is tested against): draft i <= L reruns layers 0..i-1 over the
    sequence extended by drafts 1..i-1; later drafts reuse the last layer one position
    further on its own output."""
    n, num_layers = len(ids), model.num_mtp_layers
    ext = list(ids)
    drafts = []
    with torch.inference_mode():
        for i in range(1, min(k, num_layers) + 1):
            outs = reference_mtp_hidden(model, ext, num_layers=i)
            drafts.append(int(model.logits(outs[i - 1][0, n - 2]).argmax()))
            ext.append(drafts[-1])
        if k <= num_layers:
            return drafts
        layer = num_layers - 1
        prev = reference_mtp_hidden(model, ext[:n + layer], num_layers=layer)  # input of the last layer
        hidden = (prev[-1] if prev else mtp_input_hidden(model, torch.tensor([ids])))[:, :n - 1]
        hidden = torch.cat([hidden, outs[-1][:, n - 2:n - 1]], 1)
        for m in range(1, k - num_layers + 1):
            width = n - 1 + m
            out = model.mtp_forward(layer, torch.tensor([ext[layer + 1:layer + 1 + width]]), hidden,
                                    torch.arange(width)[None])
            drafts.append(int(model.logits(out[0, -1]).argmax()))
            ext.append(drafts[-1])
            hidden = torch.cat([hidden, out[:, -1:]], 1)
    return drafts
