/** A realistic audit + watch document, as nbguard's Python side writes it (non-finite as strings). */
export function sampleDocument(): Record<string, unknown> {
  return {
    schema_version: 1,
    kind: 'audit',
    nbguard_version: '0.1.0',
    output_id: 'out-123',
    title: 'Precision audit',
    hardware: { name: 'a100', display_name: 'NVIDIA A100', compute_capability: [8, 0] },
    findings: [
      {
        rule: 'trainable-low-precision',
        severity: 'warning',
        title: 'Trainable parameters are stored in bfloat16',
        detail: 'AdamW updates smaller than bf16 resolution are lost.',
        evidence: { trainable_bf16: 18, example: 'model.layers.0.self_attn.q_proj.weight' },
        fixes: ['upcast-trainable-fp32']
      },
      {
        rule: 'fp16-on-gemma3',
        severity: 'error',
        title: 'Gemma 3 activations overflow fp16',
        detail: 'abs-max reaches inf',
        evidence: { absmax: 'inf' },
        fixes: ['use-bf16', 'missing-fix']
      }
    ],
    probe: {
      limit: 65504.0,
      modules: [
        { module: 'model.layers.0.mlp', dtype: 'torch.float16', absmax: 'inf', headroom: 0.0 },
        { module: 'model.layers.1.mlp', dtype: 'torch.float16', absmax: 1024.5, headroom: 63.93 },
        { module: 'model.layers.1.mlp.down_proj', dtype: 'torch.float16', absmax: 900, input_absmax: 'inf', headroom: null }
      ]
    },
    events: [
      {
        kind: 'nonfinite-grad',
        step: 3,
        message: 'grad norm is nan',
        cause: 'overflow',
        origins: [
          {
            module: 'model.layers.1.mlp.down_proj',
            phase: 'forward',
            dtype: 'torch.float16',
            input_absmax: 60000.0,
            output_absmax: 'inf',
            tensor: 'output',
            micro_batch: 0,
            evidence: {}
          }
        ],
        evidence: {}
      }
    ],
    history: {
      groups: ['embed', 'layers.0', 'layers.1'],
      steps: [0, 1, 2, 3],
      grad_norm: [
        [0.5, 0.4, null, 0.3],
        [1.0, 2.0, 'inf', 'nan'],
        [0.01, 0.02, 0.03, '-inf']
      ],
      skipped_steps: [3],
      loss: [2.0, 1.9, 1.8, 'nan'],
      total_grad_norm: [1.2, 2.1, 'inf', 'nan'],
      loss_scale: [65536, 65536, 32768, 16384]
    },
    fix_cells: {
      'upcast-trainable-fp32': { title: 'Keep trainable parameters in float32', code: 'nbguard.fixes.apply("upcast-trainable-fp32", model)' },
      'use-bf16': { title: 'Train in bf16', code: 'args.fp16 = False\nargs.bf16 = True' }
    }
  };
}
