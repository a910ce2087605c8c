//! Links candle (CUDA, cudarc's dynamic linking) and anyccl (NCCL loaded at run time) into
//! one binary, and uses both: candle picks a device, anyccl a backend.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = candle_core::Device::cuda_if_available(0)?;
    let t = candle_core::Tensor::arange(0f32, 8f32, &device)?;
    let backend = anyccl::pick_backend(None)?;
    println!("candle on {:?}: {t}; anyccl backend: {}", device, backend.name());
    Ok(())
}
