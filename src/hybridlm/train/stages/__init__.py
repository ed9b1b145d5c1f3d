"""The training stages, one module each (DESIGN habit 17): pretrain (+ midtrain, long-context
extension), sft, dpo, rm, distill, quantize, qad, merge. Each holds its run config, its
`TrainModule` and, for a flow stage, its `STAGE`; none imports another (import-linter's
`independence` contract). What they share lives one level up, in `hybridlm.train`."""
