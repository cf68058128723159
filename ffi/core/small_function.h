// A copyable function wrapper that keeps callables of up to `Capacity` bytes inside
// itself: std::function without the allocation.
//
// Every collective call builds its op's closures (the work, and its element-range and
// combining forms): a handful of captured sizes and flags, 24-48 bytes. libstdc++'s
// std::function stores only trivially copyable callables of at most 16 bytes in place
// and allocates for the rest, so a 4-byte all_reduce cost three allocations and frees
// before it moved a byte. With this type a call that completes on its device thread
// allocates none; a round that outlives its call copies the closures (NewRound), which
// is where any allocation belongs. Larger callables still work: they go to the heap.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

namespace jaxcomm {

template <typename Signature, size_t Capacity = 48>
class SmallFunction;

template <typename R, typename... Args, size_t Capacity>
class SmallFunction<R(Args...), Capacity> {
 public:
  SmallFunction() noexcept = default;
  SmallFunction(std::nullptr_t) noexcept {}  // NOLINT: as std::function

  template <typename F, typename D = std::decay_t<F>,
            typename = std::enable_if_t<!std::is_same_v<D, SmallFunction> && std::is_invocable_r_v<R, D&, Args...>>>
  SmallFunction(F&& f) {  // NOLINT: implicit, as std::function
    if constexpr (kInPlace<D>) {
      ::new (static_cast<void*>(buffer_)) D(std::forward<F>(f));
      ops_ = &kInPlaceOps<D>;
    } else {
      *reinterpret_cast<D**>(buffer_) = new D(std::forward<F>(f));
      ops_ = &kHeapOps<D>;
    }
  }

  SmallFunction(const SmallFunction& other) : ops_(other.ops_) {
    if (ops_ != nullptr) ops_->copy(other.buffer_, buffer_);
  }
  SmallFunction(SmallFunction&& other) noexcept : ops_(other.ops_) {
    if (ops_ != nullptr) {
      ops_->move(other.buffer_, buffer_);
      other.ops_ = nullptr;
    }
  }
  SmallFunction& operator=(const SmallFunction& other) {
    if (this != &other) *this = SmallFunction(other);
    return *this;
  }
  SmallFunction& operator=(SmallFunction&& other) noexcept {
    if (this != &other) {
      Reset();
      if (other.ops_ != nullptr) {
        other.ops_->move(other.buffer_, buffer_);
        ops_ = std::exchange(other.ops_, nullptr);
      }
    }
    return *this;
  }
  SmallFunction& operator=(std::nullptr_t) noexcept {
    Reset();
    return *this;
  }
  ~SmallFunction() { Reset(); }

  // As std::function: calls the callable as a non-const lvalue.
  R operator()(Args... args) const { return ops_->invoke(buffer_, std::forward<Args>(args)...); }

  explicit operator bool() const noexcept { return ops_ != nullptr; }
  friend bool operator==(const SmallFunction& f, std::nullptr_t) noexcept { return !f; }
  friend bool operator!=(const SmallFunction& f, std::nullptr_t) noexcept { return static_cast<bool>(f); }
  friend bool operator==(std::nullptr_t, const SmallFunction& f) noexcept { return !f; }
  friend bool operator!=(std::nullptr_t, const SmallFunction& f) noexcept { return static_cast<bool>(f); }

 private:
  struct Ops {
    R (*invoke)(void* storage, Args&&... args);
    void (*copy)(const void* from, void* to);
    void (*move)(void* from, void* to) noexcept;  // leaves `from` destroyed
    void (*destroy)(void* storage) noexcept;
  };

  template <typename D>
  static constexpr bool kInPlace = sizeof(D) <= Capacity && alignof(D) <= alignof(std::max_align_t) &&
                                   std::is_nothrow_move_constructible_v<D>;

  template <typename D>
  static constexpr Ops kInPlaceOps = {
      [](void* s, Args&&... args) -> R { return (*static_cast<D*>(s))(std::forward<Args>(args)...); },
      [](const void* from, void* to) { ::new (to) D(*static_cast<const D*>(from)); },
      [](void* from, void* to) noexcept {
        ::new (to) D(std::move(*static_cast<D*>(from)));
        static_cast<D*>(from)->~D();
      },
      [](void* s) noexcept { static_cast<D*>(s)->~D(); },
  };

  template <typename D>
  static constexpr Ops kHeapOps = {
      [](void* s, Args&&... args) -> R { return (**static_cast<D**>(s))(std::forward<Args>(args)...); },
      [](const void* from, void* to) { *static_cast<D**>(to) = new D(**static_cast<D* const*>(from)); },
      [](void* from, void* to) noexcept { *static_cast<D**>(to) = *static_cast<D**>(from); },
      [](void* s) noexcept { delete *static_cast<D**>(s); },
  };

  void Reset() noexcept {
    if (ops_ != nullptr) std::exchange(ops_, nullptr)->destroy(buffer_);
  }

  alignas(std::max_align_t) mutable unsigned char buffer_[Capacity];
  const Ops* ops_ = nullptr;
};

}  // namespace jaxcomm
