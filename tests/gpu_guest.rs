//! A guest on the app's device: `Engine::from_device` keeps the app's
//! uncaptured-error handler (an app-side validation error reaches it), the
//! engine's own device errors come back as typed errors and never reach
//! that handler, and the engine plans with the device's features.

mod common;

use common::{run_gpu_values, Case};
use flashattn::{Engine, Error, ForwardInputs};
use flashattn_testkit::{available, Need};
use std::sync::{Arc, Mutex};

/// The app's adapter and a device it opened with the features it wants,
/// or `None` (waived) where there is no adapter.
fn app_device() -> Option<(wgpu::Adapter, wgpu::Device, wgpu::Queue)> {
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapter = pollster::block_on(instance.request_adapter(&Default::default()));
    let adapter = match adapter {
        Ok(a) => a,
        Err(e) => {
            available(Need::Adapter, Err(e.to_string()));
            return None;
        }
    };
    let features = adapter.features() & (wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP);
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("the app's device"),
        required_features: features,
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .expect("the adapter opens a device with its own features and limits");
    Some((adapter, device, queue))
}

#[test]
fn guest_keeps_the_apps_error_handler() {
    let Some((adapter, device, queue)) = app_device() else {
        return;
    };
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let sink = seen.clone();
    device.on_uncaptured_error(Arc::new(move |e| sink.lock().unwrap().push(e.to_string())));
    let engine = Engine::from_device(&adapter, device.clone(), queue).unwrap();

    // The engine sees the device as the app opened it.
    assert_eq!(engine.features(), device.features());
    assert_eq!(engine.limits(), &device.limits());
    let caps = engine.caps();
    let has = |f| device.features().contains(f);
    assert_eq!(caps.shader_f16, has(wgpu::Features::SHADER_F16));
    assert_eq!(caps.subgroup.is_some(), has(wgpu::Features::SUBGROUP));
    assert_eq!(engine.adapter_info().name, adapter.get_info().name);

    // An engine call leaves nothing for the app's handler.
    let case = Case::new(5, 9, 16);
    run_gpu_values(&engine, &case);
    assert!(
        seen.lock().unwrap().is_empty(),
        "{:?}",
        seen.lock().unwrap()
    );

    // The app's own mistake (a buffer both MAP_READ and MAP_WRITE) is the
    // app's: its handler receives it, and the next engine call still runs.
    let _bad = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("the app's bad buffer"),
        size: 16,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::MAP_WRITE,
        mapped_at_creation: false,
    });
    assert_eq!(seen.lock().unwrap().len(), 1, "{:?}", seen.lock().unwrap());
    run_gpu_values(&engine, &case);
    assert_eq!(seen.lock().unwrap().len(), 1, "{:?}", seen.lock().unwrap());

    // The engine's own device errors (every buffer and kernel on a
    // destroyed device) come back typed, and reach no handler.
    device.destroy();
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let err = engine
        .forward(&ForwardInputs::new(q, k, v), &case.opts)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Device { .. } | Error::OutOfMemory { .. } | Error::DeviceLost
        ),
        "{err:?}"
    );
    assert_eq!(seen.lock().unwrap().len(), 1, "{:?}", seen.lock().unwrap());
}
